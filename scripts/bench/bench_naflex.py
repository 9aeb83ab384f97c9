"""NaFlex training throughput at each sequence length on this CPU: configs/tiny/naflex.yaml trained at one
length at a time (same budget of patches per step), end to end through the trainer (loader workers,
patchify in the workers, the NaFlexVit tower, sigmoid loss), samples/s and patches/s after the first window.

    python scripts/bench/bench_naflex.py                     # lengths 4 16 36 64, 40 steps each, 3 repeats
    python scripts/bench/bench_naflex.py --lengths 16 --repeats 1

No anchor runs beside it: open_clip's NaFlex trainer is in its unreleased main branch, not installable here.
Writes bench_results/naflex.json: headline ``ratio`` = patches/s at the longest length / at the shortest
(higher is better: 1 would mean a step costs the same per patch whatever the length).

Beside it, what a GPU would wait for: host reads of device values (``aten._local_scalar_dense``, each a
device-to-host wait on a GPU) in one forward of the tiny tower at each length's batch, with timm 1.0.31's
grid lookup (2 per sample) and with ours (mmpretrain.models.naflex.grid_sizes: the loader's host grids).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchlib import median, table, write_result

ROOT = Path(__file__).resolve().parents[2]


def run(length: int, budget: int, steps: int, data: str, workers: int) -> float:
    """samples/s of the log's records after the first ``log_every`` window."""
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "mmpretrain.train", "--config", str(ROOT / "configs/tiny/naflex.yaml"),
               f"run_dir={d}/run", f"data.train={data}", f"data.naflex={{seq_lens: [{length}], max_tokens_per_batch: {budget}}}",
               f"train.steps={steps}", "train.epochs=null", "optim.warmup_steps=1", "train.log_every=10",
               "train.progress=false", "train.plots=false", "train.log_with=[]", "train.save_every=100000",
               f"data.num_workers={workers}"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
        if r.returncode:
            raise SystemExit(f"training at {length} patches failed:\n{r.stderr[-2000:]}")
        records = [json.loads(x) for x in (Path(d) / "run/log.jsonl").read_text().splitlines()]
        rates = [x["samples_per_s"] for x in records if "samples_per_s" in x and x["step"] > 10]
        return median(rates)


class ScalarReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def host_reads(length: int, budget: int) -> dict[str, int]:
    """Scalar reads in one forward of ``mmpt_naflexvit_tiny`` over ``budget // length`` square images at
    ``length`` patches, timm's grid lookup against ours (the grids read from the loader's host tensor)."""
    import timm
    from timm.models import naflexvit

    from mmpretrain.data.naflex import grid_for, host_grids, pack, with_grids
    from mmpretrain.models import naflex

    tower = timm.create_model("mmpt_naflexvit_tiny", num_classes=0).eval()
    gh, gw = grid_for(64, 64, 8, length)
    n = budget // length
    patches, coord, valid = pack([torch.rand(gh * gw, 192)] * n, [(gh, gw)] * n, length)
    out = {}
    for name, lookup, grids in (("timm", naflex.timm_grid_sizes, None), ("ours", naflex.grid_sizes, host_grids(coord))):
        naflexvit.calculate_naflex_grid_sizes = lookup
        x = {"patches": patches, "patch_coord": with_grids(coord.clone(), grids), "patch_valid": valid}
        with torch.no_grad(), ScalarReads() as reads:
            tower(x)
        out[name] = reads.n
    naflexvit.calculate_naflex_grid_sizes = naflex.grid_sizes
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", type=int, nargs="+", default=[4, 16, 36, 64])
    p.add_argument("--budget", type=int, default=1024, help="patches per step (max_tokens_per_batch)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--data", default=str(ROOT / "data/openmoji/train"))
    args = p.parse_args()
    rows, out = [], {}
    for n in args.lengths:
        runs = [run(n, args.budget, args.steps, args.data, args.workers) for _ in range(args.repeats)]
        batch = args.budget // n
        out[n] = {"batch": batch, "samples_per_s": runs, "patches_per_s": [r * n for r in runs]}
        rows.append((n, batch, f"{median(runs):.0f}", f"{min(runs):.0f}-{max(runs):.0f}", f"{median(runs) * n:,.0f}"))
    print(table(rows, ("patches", "batch", "samples/s", "spread", "patches/s")))
    reads = {n: host_reads(n, args.budget) for n in args.lengths}
    print(table([(n, args.budget // n, r["timm"], r["ours"]) for n, r in reads.items()],
                ("patches", "batch", "host reads/forward, timm's grids", "ours")))
    lo, hi = min(args.lengths), max(args.lengths)
    ratios = [a / b for a, b in zip(out[hi]["patches_per_s"], out[lo]["patches_per_s"])]
    path = write_result("naflex", median(ratios), True, 1.0, ratios,
                        {"lengths": {str(k): {**v, "host_reads_per_forward": reads[k]} for k, v in out.items()},
                         "budget": args.budget, "steps": args.steps,
                         "workers": args.workers, "cpu": os.cpu_count()})
    print(f"patches/s at {hi} / at {lo}: {median(ratios):.2f} -> {path}")


if __name__ == "__main__":
    main()
