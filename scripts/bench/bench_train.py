"""End-to-end training throughput: ``python -m mmpretrain.train`` against open_clip_train's own
``main`` on the same model, shards, transform, tokenizer, batch, workers, precision and steps,
alternating in one run; plus the cost of the soft-target and region-weighting objectives over plain
CLIP in our trainer.

    python scripts/bench/bench_train.py [--steps 50] [--repeats 3] [--batch-size 128] [--workers 2]
                                  [--shard-px 256] [--arch mmpt-tiny-vit] [--image-heavy-arch mmpt-tiny-vit-p4]

Data: the packaged OpenMoji emoji built by ``data_tools build demo:openmoji`` as --shard-px JPEG
shards (web data as img2dataset writes it) and embedded with all-MiniLM-L6-v2 (``data_tools embed``),
in a temporary folder. Model: the packaged ``mmpt-tiny-vit`` (32 px ViT and a 4-layer text
transformer, ~8M trainable parameters in both towers), fp32, AdamW (lr 1e-3, betas 0.9/0.98, eps
1e-6, wd 0.1, 20 warm-up steps), registered with open_clip so both trainers build it from the same
JSON. Both sample shards with replacement for exactly --steps batches (open_clip:
``--dataset-resampled --train-num-samples``, ours: ``data.mode=resampled data.num_samples``).

Variants, each a fresh process per repeat, order rotated per repeat:
``open_clip`` (open_clip_train.main), ``ours`` (CLIP), ``ours_soft`` (CLIP + 0.5 soft-target CLIP,
as the demo), ``ours_regions`` (region-weighted CLIP, scales [5, 10, 20], active from step 0, k-means
every 20 steps), ``ours_global`` (``global_clip``, FastCLIP-v3; not in the default set: ``--variants ours
ours_global --image-heavy-arch ''`` writes bench_results/train_global_clip.json, seconds per step over CLIP),
``ours_resa`` / ``ours_resa_ema`` (CLIP + 0.5 x resa, online / momentum encodings) and ``ours_negatives``
(CLIP with hard-negative captions from ``data_tools negatives``): ``--variants ours ours_resa ours_resa_ema
ours_negatives --image-heavy-arch ''`` writes bench_results/train_objective_cost.json, seconds per step over CLIP, ``ours_bf16`` (CLIP under ``train.precision=bf16``: CPU autocast; the CPU's bf16 and
fp32 GEMM rates are probed and recorded, since bf16 is native on AVX-512 BF16 / AMX CPUs and
emulated elsewhere). The fp32 and bf16 runs are also evaluated (zero-shot acc1 on the held-out
OpenMoji classes) to show what bf16 costs in accuracy. The text-heavy packaged model is where text
trimming pays most (emoji names use ~10 of 32 token columns); ``--image-heavy-arch`` (default
``mmpt-tiny-vit-p4``: ViT 32 px, patch 4, width 128, 4 layers, 65 image tokens) repeats
open_clip / ours / ours_bf16 where the image tower dominates. Throughput is each trainer's own per-window wall time (10 steps between log lines,
data waiting included), the first window (start-up) dropped, median over windows; peak RSS is the
process tree's (trainer + loader workers), polled every 0.2 s; the loss is the last logged one.
Writes bench_results/train.json: ratio = ours / open_clip samples/s (higher is better), with
``soft_target_ratio`` and ``regions_ratio`` (seconds per step over plain CLIP, lower is better),
``bf16_ratio`` (bf16 / fp32 samples/s, higher is better), ``acc1`` per variant, ``cpu`` and
``image_heavy`` (the same for the image-heavy model) in ``extra``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import table, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LOG_EVERY = 10

OPEN_CLIP_MAIN = (
    "import sys, open_clip; open_clip.add_model_config(sys.argv[1]); "
    "from open_clip_train.main import main; main(sys.argv[2:])"
)


def run_tree(cmd: list[str], env: dict) -> tuple[float, int, subprocess.CompletedProcess]:
    """Run ``cmd``; returns wall seconds, the peak RSS (bytes) of its process tree, and the result."""
    import psutil

    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak, ps = 0, psutil.Process(proc.pid)
    out_chunks: list[str] = []
    import threading

    def drain(stream, sink):
        sink.append(stream.read())

    err: list[str] = []
    threads = [threading.Thread(target=drain, args=(proc.stdout, out_chunks)),
               threading.Thread(target=drain, args=(proc.stderr, err))]
    for t in threads:
        t.start()
    while proc.poll() is None:
        try:
            rss = ps.memory_info().rss + sum(c.memory_info().rss for c in ps.children(recursive=True))
            peak = max(peak, rss)
        except psutil.Error:
            pass
        time.sleep(0.2)
    for t in threads:
        t.join()
    res = subprocess.CompletedProcess(cmd, proc.returncode, "".join(out_chunks), "".join(err))
    return time.perf_counter() - t0, peak, res


def open_clip_cmd(data: Path, pattern: str, out: Path, args) -> list[str]:
    return [sys.executable, "-c", OPEN_CLIP_MAIN, str(ROOT / "mmpretrain/model_configs"),
            "--train-data", pattern, "--dataset-type", "webdataset", "--dataset-resampled",
            "--train-num-samples", str(args.steps * args.batch_size), "--batch-size", str(args.batch_size),
            "--workers", str(args.workers), "--epochs", "1", "--precision", "fp32", "--model", args.arch,
            "--lr", "1e-3", "--beta1", "0.9", "--beta2", "0.98", "--eps", "1e-6", "--wd", "0.1", "--warmup", "20",
            "--log-every-n-steps", str(LOG_EVERY), "--logs", str(out), "--name", "run", "--save-frequency", "0",
            "--report-to", "", "--seed", "0", "--device", "cpu"]


def ours_cmd(data: Path, out: Path, args, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "mmpretrain.train", "--config", str(ROOT / "configs/tiny/clip.yaml"),
            f"data.train={data}", f"run_dir={out}", "data.mode=resampled",
            f"data.num_samples={args.steps * args.batch_size}", f"data.batch_size={args.batch_size}",
            f"data.num_workers={args.workers}", f"model.arch={args.arch}", "optim.warmup_steps=20",
            "train.epochs=null", f"train.steps={args.steps}", f"train.log_every={LOG_EVERY}",
            "train.progress=false", "train.save_every=null", "train.diagnostics_every=null", "optim.grad_clip_norm=null",
            *overrides]


OURS = {  # variant -> overrides of configs/tiny/clip.yaml
    "ours": ["loss=[{name: clip}]"],
    "ours_soft": ["loss=[{name: clip}, {name: soft_target, weight: 0.5, options: {target_temperature: 0.05}}]"],
    "ours_regions": ["loss=[{name: regions, options: {base: clip, scales: [5, 10, 20], bank_size: 1024, "
                     "refresh_every: 20}}]"],
    "ours_bf16": ["loss=[{name: clip}]", "train.precision=bf16"],
    # FastCLIP-v3's objective (per-sample normaliser tables, updated after each accepted step)
    "ours_global": ["loss=[{name: global_clip, options: {gamma: 0.2, gamma_schedule: cosine, gamma_decay_epochs: 5, "
                    "rho: 6.5}}]"],
    # self-assigned targets (resa, ReSA) beside CLIP at X-CLR's weight: online, and from the weight average
    "ours_resa": ["loss=[{name: clip}, {name: resa, weight: 0.5}]"],
    "ours_resa_ema": ["loss=[{name: clip}, {name: resa, weight: 0.5, options: {encodings: ema}}]",
                      "train.ema={decay: 0.99}"],
    # CLIP with a hard-negative caption per sample (data_tools negatives' copy of the shards)
    "ours_negatives": ["loss=[{name: clip, options: {hard_negatives: true}}]", "data.train={negatives}"],
    # ablations (not in the default set): open_clip_train's optimizer kernel, workers at full priority
    "ours_for_loop_adamw": ["loss=[{name: clip}]", "optim.implementation=for_loop"],
    "ours_worker_nice0": ["loss=[{name: clip}]", "data.worker_nice=0"],
}
DEFAULT = ["open_clip", "ours", "ours_soft", "ours_regions", "ours_bf16"]
IMAGE_HEAVY = ["open_clip", "ours", "ours_bf16"]
EVALUATED = ("ours", "ours_bf16")  # held-out zero-shot acc1 after training


def cpu_rates() -> dict:
    """What this CPU does with bf16: torch's capability and GEMM GFLOP/s (2 threads, 1024^3, 0.3 s each)."""
    import torch

    out = {"capability": torch.backends.cpu.get_cpu_capability()}
    for dt in (torch.float32, torch.bfloat16):
        a, b = torch.randn(1024, 1024, dtype=dt), torch.randn(1024, 1024, dtype=dt)
        a @ b
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < 0.3:
            a @ b
            n += 1
        out[f"{str(dt).removeprefix('torch.')}_gflops"] = round(2 * 1024**3 * n / (time.perf_counter() - t0) / 1e9)
    return out


def held_out_acc1(run: Path, dataset: Path, env: dict) -> float:
    r = subprocess.run([sys.executable, "-m", "mmpretrain.eval", "--model", str(run), "--dataset", str(dataset),
                        "--task", "zeroshot_classification", "--num_workers", "0", "--output", str(run / "results.json")],
                       cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"evaluation of {run} failed: {r.stderr[-2000:]}")
    return json.loads((run / "results.json").read_text())["results"][0]["metrics"]["acc1"]


def throughput_open_clip(log: str, batch: int) -> tuple[float, float | None]:
    """Median samples/s over the logged windows (the first, start-up, dropped) and the last loss."""
    windows = [float(x) for x in re.findall(r"Batch \(t\): ([0-9.]+),", log)]
    losses = re.findall(r"Contrastive_loss: ([0-9.]+)", log)
    return batch / statistics.median(windows[1:] or windows), float(losses[-1]) if losses else None


def throughput_ours(run: Path) -> tuple[float, float | None]:
    recs = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    rates = [r["samples_per_s"] for r in recs]
    return statistics.median(rates[1:] or rates), recs[-1]["loss"] if recs else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--shard-px", type=int, default=256)
    p.add_argument("--arch", default="mmpt-tiny-vit")
    p.add_argument("--image-heavy-arch", default="mmpt-tiny-vit-p4", help="'' to skip the image-heavy model")
    p.add_argument("--variants", nargs="+", default=DEFAULT, choices=["open_clip", *OURS])
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the embed step below loads MiniLM from the seeded cache
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
    from data_tools.build import build
    from data_tools.embed import embed
    from mmpretrain.config.base import DEMO_TEXT_MODEL

    print(f"cpu: {cpu_rates()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "openmoji"
        build("demo:openmoji", root, image_size=args.shard_px, shard_size=100, image_format="jpg")
        data = root / "train"
        embed(data, DEMO_TEXT_MODEL)
        if "ours_negatives" in args.variants:
            from data_tools.negatives import negatives

            negatives(data, root / "train_negatives")
        results = bench_arch(args, args.arch, args.variants, root, Path(tmp) / "main", env)
        heavy = (bench_arch(args, args.image_heavy_arch, IMAGE_HEAVY, root, Path(tmp) / "heavy", env)
                 if args.image_heavy_arch else None)
    extra: dict = {"steps": args.steps, "batch_size": args.batch_size, "workers": args.workers, "arch": args.arch,
                   "shard_px": args.shard_px, "cpu": cpu_rates(), **summary(results, args), "per_variant": results}
    if heavy is not None:
        extra["image_heavy"] = {"arch": args.image_heavy_arch, **summary(heavy, args), "per_variant": heavy}
    ratios = extra.pop("ratio_runs", [])
    extra.pop("ratio", None), extra.pop("runs", None)  # the headline ratio and runs of the JSON itself
    if heavy is not None:
        extra["image_heavy"].pop("ratio_runs", None)
    if ratios:
        path = write_result("train", statistics.median(ratios), True, 1.2, ratios, extra)
        print(f"ratio {statistics.median(ratios):.3f} (ours / open_clip_train samples/s; target >= 1.2) -> {path}")
    elif "global_clip_ratio" in extra:  # --variants ours ours_global: the objective's own overhead, its own JSON
        runs = extra["global_clip_ratio_runs"]
        path = write_result("train_global_clip", statistics.median(runs), False, 1.05, runs, extra)
        print(f"global_clip / clip seconds per step {statistics.median(runs):.3f} (target <= 1.05) -> {path}")
    elif any(k in extra for k in ("resa_ratio", "resa_ema_ratio", "negatives_ratio")):
        # --variants ours ours_resa ours_resa_ema ours_negatives: those objectives' cost over CLIP, their own JSON
        key = next(k for k in ("resa_ratio", "resa_ema_ratio", "negatives_ratio") if k in extra)
        runs = extra[key + "_runs"]
        path = write_result("train_objective_cost", statistics.median(runs), False, 1.5, runs, extra)
        print(f"{key} seconds per step over clip {statistics.median(runs):.3f} -> {path}")
    return 0


def bench_arch(args, arch: str, variants: list[str], root: Path, tmp: Path, env: dict) -> dict[str, list[dict]]:
    """Every variant on ``arch``, ``--repeats`` times in rotated order; evaluated ones get ``acc1``."""
    data = root / "train"
    shards = sorted(x.name for x in data.glob("*.tar"))
    pattern = str(data / f"openmoji-train-{{000000..{len(shards) - 1:06d}}}.tar")
    run_args = argparse.Namespace(**{**vars(args), "arch": arch})
    results: dict[str, list[dict]] = {v: [] for v in variants}
    for rep in range(args.repeats):
        order = variants[rep % len(variants):] + variants[:rep % len(variants)]
        for v in order:
            out = tmp / f"{v}_{rep}"
            overrides = [o.replace("{negatives}", str(root / "train_negatives")) for o in OURS.get(v, [])]
            cmd = open_clip_cmd(data, pattern, out, run_args) if v == "open_clip" else ours_cmd(data, out, run_args,
                                                                                                  overrides)
            wall, rss, res = run_tree(cmd, env)
            if res.returncode != 0:
                print(res.stdout[-2000:], res.stderr[-4000:], file=sys.stderr)
                raise SystemExit(f"{v} on {arch} failed (exit {res.returncode})")
            if v == "open_clip":
                rate, loss = throughput_open_clip((out / "run/out.log").read_text(), args.batch_size)
            else:
                rate, loss = throughput_ours(out)
            rec = {"samples_per_s": rate, "peak_rss_mb": rss / 2**20, "loss": loss, "wall_s": wall}
            if v in EVALUATED:  # after the timed run, so it does not disturb the timing
                rec["acc1"] = held_out_acc1(out, root, env)
            results[v].append(rec)
            print(f"{arch} repeat {rep + 1} {v}: {rate:.1f} samples/s, peak RSS {rss / 2**20:.0f} MiB, "
                  f"loss {loss:.3f}, {wall:.0f} s" + (f", acc1 {rec['acc1']:.3f}" if "acc1" in rec else ""),
                  flush=True)
    return results


def summary(results: dict[str, list[dict]], args) -> dict:
    """The table printed for one architecture, and its ratios (paired within each repeat)."""

    def med(v, k):
        return statistics.median(r[k] for r in results[v])

    rows = [(v, f"{med(v, 'samples_per_s'):.1f}", f"{med(v, 'peak_rss_mb'):.0f}", f"{med(v, 'loss'):.3f}",
             f"{med(v, 'acc1'):.3f}" if "acc1" in results[v][0] else "-") for v in results]
    print(table(rows, ("variant", "samples/s", "peak RSS MiB", f"loss at step {args.steps}", "held-out acc1")))
    out: dict = {}
    if "open_clip" in results and "ours" in results:
        out["ratio_runs"] = [o["samples_per_s"] / a["samples_per_s"] for o, a in zip(results["ours"], results["open_clip"])]
        out["ratio"] = round(statistics.median(out["ratio_runs"]), 4)
        out["runs"] = [round(x, 4) for x in out["ratio_runs"]]
        out["rss_ratio"] = round(med("ours", "peak_rss_mb") / med("open_clip", "peak_rss_mb"), 3)
    for v, key in (("ours_soft", "soft_target_ratio"), ("ours_regions", "regions_ratio"),
                   ("ours_global", "global_clip_ratio"), ("ours_resa", "resa_ratio"),
                   ("ours_resa_ema", "resa_ema_ratio"), ("ours_negatives", "negatives_ratio"),
                   ("ours_for_loop_adamw", "for_loop_adamw_ratio"), ("ours_worker_nice0", "worker_nice0_ratio")):
        if v in results and "ours" in results:  # seconds per step over plain CLIP, same repeat
            runs = [b["samples_per_s"] / r["samples_per_s"] for r, b in zip(results[v], results["ours"])]
            out[key] = round(statistics.median(runs), 4)
            out[key + "_runs"] = [round(x, 4) for x in runs]
            print(f"{key}: {out[key]:.3f} (runs {', '.join(f'{x:.3f}' for x in runs)}; lower is better)")
    if "ours_bf16" in results and "ours" in results:  # samples/s over fp32, same repeat: higher is better
        runs = [b["samples_per_s"] / r["samples_per_s"] for b, r in zip(results["ours_bf16"], results["ours"])]
        out["bf16_ratio"] = round(statistics.median(runs), 4)
        out["bf16_ratio_runs"] = [round(x, 4) for x in runs]
        out["acc1"] = {v: round(med(v, "acc1"), 4) for v in EVALUATED if v in results}
        print(f"bf16_ratio: {out['bf16_ratio']:.3f} (runs {', '.join(f'{x:.3f}' for x in runs)}; higher is better); "
              f"held-out acc1 {out['acc1']}")
    return out


if __name__ == "__main__":
    sys.exit(main())
