"""The data-parallel checks, under one ``accelerate launch`` of 2 CPU processes (DDP over gloo): run by
the session fixture ``ddp_checks`` (tests/conftest.py) for every test that reads its report
(tests/test_ddp.py, test_train.py, test_slice.py, test_engines.py): each launch costs ~15 s of process
start-up and imports on 2 cores. argv[1]: a JSON plan, in the order run:

- ``train``: ``python -m mmpretrain.train``'s arguments, run through its ``main`` on both ranks (as
  ``accelerate launch -m mmpretrain.train`` would); its exit status under ``train_exit``.
- ``eval``: ``python -m mmpretrain.eval``'s arguments, run the same way (the rank split, one table
  printed and one results file written by the main process); ``eval_exit``.
- ``checks``, on the real shards ``data``:
  - ``unused`` (``unused_<case>``): an objective that leaves a model parameter unused -- vrn alone and
    align_uniform alone (no logit scale), clip on an architecture that owns a logit bias -- trains 3
    steps (DDP stops at step 2 when a parameter it registered gets no gradient);
  - ``masks`` (``same_initial_weights``, ``masks_differ``): with patch dropout, the same images on both
    ranks draw different masks right after setup (each rank its own seed), while the initial weights
    are the same on both;
  - ``steps``: tests/scripts/step_equivalence.py's float64 steps with the global batch split over the 2
    ranks (its ``default`` set).
  - ``nonfinite`` (``nonfinite``): the loss non-finite on rank 1 only, at step 2 of 4, with
    train.nonfinite=skip and a log every 2 steps: both ranks skip it on the device (the flag is
    all-reduced), count it at the log step, and end with the same weights.
- ``runs``: ``[{"name", "args", "module"?, "env"?}]``, each ``python -m MODULE``'s arguments (default
  ``mmpretrain.train``; ``data_tools``: tests/test_data_sources.py) run through its ``cli.main``, in order, with ``env`` set for that run only (what ``accelerate launch``
  would set, e.g. ``ACCELERATE_MIXED_PRECISION``; accelerate's state is rebuilt for each run). Under
  ``runs`` in the report, by name: its exit status, its last log record, what it wrote to stderr and its seconds.
  Several runs in one launch save ~10 s of process start-up each: the damaged shards of
  tests/reliability/test_stream_fill.py, LoRA (tests/test_lora.py), and under
  tests/scripts/gpu_engine_on_cpu.py the FSDP runs of tests/test_engines.py.

The main process writes the report (JSON) to the plan's ``report``, with ``train_seconds`` and ``seconds`` (from
the end of its imports to the checks, and each check's).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from accelerate.utils import gather_object

ROOT = Path(__file__).resolve().parents[2]
START = time.perf_counter()  # after this script's imports: the report's ``seconds`` count from here
CASES = {"vrn": ["loss=[{name: vrn}]"], "align_uniform": ["loss=[{name: align_uniform}]"],
         "clip_with_bias": ["loss=[{name: clip}]", "model.overrides={init_logit_bias: -10.0}"]}


def config(data: str, run_dir: Path, *extra: str):
    from mmpretrain.config import load_config

    return load_config(ROOT / "configs/demo.yaml", [
        f"data.train={data}", f"run_dir={run_dir}", "train.steps=3", "train.epochs=null", "data.batch_size=8",
        "data.num_workers=0", "data.shuffle_buffer=0", "optim.warmup_steps=1", "train.log_every=1",
        "train.progress=false", "train.log_with=[]", "train.plots=false", *extra])


def unused(data: str, out_dir: Path, report: dict) -> bool:
    from mmpretrain.train import fit, setup

    for name, extra in CASES.items():
        run = setup(config(data, out_dir / name, *extra))
        try:
            fit(run)
            report[f"unused_{name}"] = "ok"
        except RuntimeError as e:  # DDP's unused-parameter error: the next collective would hang, stop here
            report[f"unused_{name}"] = str(e).splitlines()[0][:300]
            return False
    return True


def masks(data: str, out_dir: Path, report: dict) -> None:
    from open_clip.transformer import PatchDropout

    from mmpretrain.train import setup

    run = setup(config(data, out_dir / "masks"))
    clip = run.accelerator.unwrap_model(run.model).clip
    # a random op of the global stream (open_clip's patch dropout; model.patch_dropout draws from the sample's
    # index instead, tests/test_patch_dropout.py): each rank its own stream (seed + rank)
    clip.visual.patch_dropout = PatchDropout(0.5)
    weights = float(sum(p.detach().double().sum() for p in clip.visual.parameters()))
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    clip.train()
    with torch.no_grad():
        feats = clip.encode_image(images)
    w_all, f_all = gather_object([weights]), gather_object([feats])
    report["same_initial_weights"] = w_all[0] == w_all[1]
    report["masks_differ"] = not torch.equal(f_all[0], f_all[1])


def nonfinite(data: str, out_dir: Path, report: dict) -> None:
    from mmpretrain.train import fit, setup

    run = setup(config(data, out_dir / "nonfinite", "train.steps=4", "train.log_every=2", "train.nonfinite=skip"))
    objective, rank = run.objective, run.accelerator.process_index

    class NanOnRank1:
        def __getattr__(self, name):
            return getattr(objective, name)

        def __call__(self, **kw):
            out = objective(**kw)
            if rank == 1 and run.state.step == 2:
                out = {k: v * float("nan") if k.endswith("_loss") else v for k, v in out.items()}
            return out

    run.objective = NanOnRank1()
    fit(run)
    clip = run.accelerator.unwrap_model(run.model).clip
    weights = float(sum(p.detach().double().sum() for p in clip.parameters()))
    counts = gather_object([(run.state.nonfinite_steps, weights, run.nonfinite.on_device)])
    report["nonfinite"] = {"counts": [c[0] for c in counts], "same_weights": counts[0][1] == counts[1][1],
                           "finite_weights": all(c[1] == c[1] for c in counts), "on_device": [c[2] for c in counts]}


def run(spec: dict) -> dict:
    """One command of the plan's ``runs``: its exit status, last log record (a trainer's), stderr, seconds."""
    import contextlib
    import importlib
    import io
    import os

    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType

    command = importlib.import_module(f"{spec.get('module', 'mmpretrain.train')}.cli").main
    saved = {k: os.environ.get(k) for k in spec.get("env", {})}
    os.environ.update(spec.get("env", {}))
    # the next Accelerator reads the env afresh; accelerate wrote the engine's type (FSDP) into the process
    # state, where a fresh launch holds the backend's (the GPU one under gpu_engine_on_cpu.py)
    AcceleratorState._reset_state(reset_partial_state=False)
    if PartialState._shared_state.get("distributed_type") in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
    GradientState._reset_state()
    err, start = io.StringIO(), time.perf_counter()
    try:
        with contextlib.redirect_stderr(err):
            code = command(spec["args"])
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        sys.stderr.write(err.getvalue())
    run_dir = next((a.split("=", 1)[1] for a in spec["args"] if a.startswith("run_dir=")), None)
    log = Path(run_dir or ".") / "log.jsonl"
    lines = log.read_text().splitlines() if code == 0 and run_dir and log.is_file() else []
    return {"exit": code, "last": json.loads(lines[-1]) if lines else None, "stderr": err.getvalue()[-4000:],
            "seconds": round(time.perf_counter() - start, 1)}


def main(plan_path: str) -> None:
    from accelerate import PartialState

    plan = json.loads(Path(plan_path).read_text())
    report: dict = {}
    ok = True
    # the CLI's end_training destroys the process group, as a launched process ends; here more work
    # follows in the same processes, so the group is kept until the end of this script (re-creating
    # it on the launcher's port hung about one run in two)
    destroy, PartialState.destroy_process_group = PartialState.destroy_process_group, lambda self, group=None: None
    if plan.get("train"):
        from mmpretrain.train.cli import main as train

        start = time.perf_counter()
        report["train_exit"] = train(plan["train"])
        report["train_seconds"] = round(time.perf_counter() - start, 1)
        ok = report["train_exit"] == 0
    if ok and plan.get("eval"):
        from mmpretrain.eval.cli import main as evaluate

        report["eval_exit"] = evaluate(plan["eval"])
        ok = report["eval_exit"] == 0
    checks, data, out_dir = plan.get("checks", []), plan.get("data"), Path(plan.get("work", "."))
    seconds = report["seconds"] = {"before_checks": round(time.perf_counter() - START, 1)}
    for name in ("unused", "masks", "steps", "nonfinite"):
        if ok and name in checks:
            start = time.perf_counter()
            if name == "unused":
                ok = unused(data, out_dir, report)
            elif name == "masks":
                masks(data, out_dir, report)
            elif name == "steps":
                from step_equivalence import main as steps  # this script's folder is on sys.path

                report["steps"] = steps(None, "default")
            else:
                nonfinite(data, out_dir, report)
            seconds[name] = round(time.perf_counter() - start, 1)
    if ok and plan.get("runs"):
        report["runs"] = {spec["name"]: run(spec) for spec in plan["runs"]}
    if PartialState().is_main_process:
        Path(plan["report"]).write_text(json.dumps(report))
    destroy(PartialState())


if __name__ == "__main__":
    main(sys.argv[1])
