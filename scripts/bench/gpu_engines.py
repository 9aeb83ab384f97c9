"""The GPU check's engines section (scripts/bench/gpu_bench.py documents it): cold ``accelerate launch``
runs of each engine's shipped config -- train, resume, and for some export and evaluation -- and what
they wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from gpu_common import ROOT

ENGINES = {"ddp": "1gpu", "fsdp": "fsdp", "deepspeed": "deepspeed-zero2"}
# the stages each engine's smoke runs: every cold launch costs its imports, so evaluation (which reads
# any engine's consolidated checkpoint the same way) runs once, on the FSDP run
STAGES = {"ddp": ("train", "resume"), "fsdp": ("train", "resume", "eval", "export"),
          "deepspeed": ("train", "resume", "export")}


def run_cmd(cmd: list[str], timeout: int) -> tuple[int, float, str]:
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
        return r.returncode, time.perf_counter() - t0, (r.stdout + r.stderr)[-2500:]
    except subprocess.TimeoutExpired as e:
        return 124, time.perf_counter() - t0, f"timed out after {timeout} s: {str(e.stderr)[-2000:]}"


def engine_smoke(engine: str, args, data: Path, work: Path) -> dict:
    run_dir = work / engine
    wrapper = args.engine_wrapper if engine != "ddp" and args.engine_wrapper else None
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
              str(ROOT / f"configs/accelerate/{ENGINES[engine]}.yaml"), "--num_processes", "1",
              "--mixed_precision", "no" if args.precision == "fp32" else args.precision]
    if engine == "fsdp" and args.device == "cpu":
        launch += ["--fsdp_sync_module_states", "false"]  # it broadcasts from CUDA
    launch += [wrapper] if wrapper else ["-m"]
    common = ["mmpretrain.train", "--config", str(ROOT / "configs/tiny/soft_target.yaml"),
              f"data.train={data / 'train'}", f"run_dir={run_dir}", "train.epochs=null", "data.batch_size=32",
              "data.num_workers=1", "optim.warmup_steps=1", "train.log_every=1", "train.save_every=3",
              "train.progress=false", "train.log_with=[]", f"train.precision={args.precision}"]
    res: dict = {"config": f"configs/accelerate/{ENGINES[engine]}.yaml"}
    stages = [("train", [*launch, *common, "train.steps=6"]),
              ("resume", [*launch, *common, "train.steps=8"]),
              ("eval", [sys.executable, "-m", "mmpretrain.eval", "--model", str(run_dir), "--dataset",
                        str(data / "test"), "--task", "zeroshot_classification", "--output",
                        str(run_dir / "results.json"), "--num_workers", "1"]),
              ("export", [sys.executable, "-m", "mmpretrain.export", str(run_dir), "--out", str(run_dir / "export")])]
    stages = [(stage, cmd) for stage, cmd in stages if stage in STAGES[engine]]
    for stage, cmd in stages:
        rc, dt, tail = run_cmd(cmd, args.stage_timeout)
        res[stage] = {"rc": rc, "seconds": round(dt, 1)}
        if rc != 0:
            res[stage]["output_tail"] = tail
            break
        if stage == "resume":  # from what the run wrote, not what it printed (warnings can bury a line)
            res[stage].update(resumed_from_files(run_dir, first=6, last=8))
    log = run_dir / "log.jsonl"
    if log.is_file():
        recs = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
        res["losses"] = {r["step"]: round(r["loss"], 5) for r in recs if "loss" in r}
    if engine != "ddp":
        res["sharding"] = ("one process: FSDP runs NO_SHARD and ZeRO-2 partitions nothing here; sharded training, "
                           "checkpoints and resume are proven on 2 gloo ranks by tests/test_engines.py")
    if (run_dir / "results.json").is_file():
        res["acc1"] = next((v for k, v in _flat(json.loads((run_dir / "results.json").read_text())) if k.endswith("acc1")),
                           None)
    res["export_files"] = sorted(p.name for p in (run_dir / "export").iterdir()) if (run_dir / "export").is_dir() else []
    res["ok"] = all(res.get(s, {}).get("rc") == 0 for s, _ in stages) and res["resume"].get("resumed", False)
    return res


def resumed_from_files(run_dir: Path, first: int, last: int) -> dict:
    """Whether the second launch continued the first from its step-``first`` checkpoint to ``last``:
    log.jsonl holds each step 1..last once (a restart would repeat 1..first) and the checkpoint of
    ``last`` is complete beside ``first``'s."""
    log = run_dir / "log.jsonl"
    recs = [json.loads(x) for x in log.read_text().splitlines() if x.strip()] if log.is_file() else []
    steps = [r["step"] for r in recs if "loss" in r]
    done = sorted(int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step_*")
                  if (p / "train_state.json").is_file())
    ok = sorted(set(steps)) == list(range(1, last + 1)) and len(steps) == len(set(steps)) and {first, last} <= set(done)
    return {"resumed": ok, "logged_steps": steps, "checkpoints": done}


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat(v, f"{prefix}{k}/")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _flat(v, f"{prefix}{i}/")
    else:
        yield prefix.rstrip("/"), tree
