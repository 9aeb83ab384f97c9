"""Cost of region weighting: the whole training step (next batch, forward, objective, backward,
optimizer) with the region-weighted CLIP objective over plain CLIP, same model, data and settings,
alternating blocks of steps in one process.

    python scripts/bench/bench_regions.py [--config configs/tiny/regions.yaml] [--steps 20] [--repeats 4]
                                    [--scales 5 10 20] [--batch-size 128]

Both runs are built by ``mmpretrain.train.setup`` from --config (its model, data and the region
options); the baseline replaces the objective by its base. The regions are active from the first
step (warm-up off) and a block of --steps holds one k-means refresh at the config's
``refresh_every`` (tiny config: every 20 steps, the most frequent of the packaged configs), so the
clustering cost is in the measurement. The first block of each is discarded (start-up, bank filling).
Data: the packaged OpenMoji shards (``make demo`` builds data/openmoji). Writes
bench_results/regions.json (ratio = regions / plain seconds per step, lower is better).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from benchlib import median, table, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def objective_only(options: dict, scales: list[int], dim: int = 512, repeats: int = 10) -> dict:
    """Milliseconds of the objective alone (forward + backward on random unit features, regions active,
    no re-clustering in the timed calls) at the bench's batch and at a GPU-sized global batch."""
    import torch
    import torch.nn.functional as F

    from mmpretrain.losses import LOSSES, total_of

    res = {}
    for b in (128, 1024):
        base = options.get("base", "clip")
        mods = {"plain": LOSSES[base](**options.get("base_options", {})),
                "regions": LOSSES["regions"](**dict(options, scales=scales, refresh_every=10**9, warmup_steps=0,
                                                    warmup_epochs=0, bank_size=max(options.get("bank_size", 0), b)))}
        res[b] = {}
        for name, mod in mods.items():
            ts = []
            for i in range(repeats + 1):
                x = F.normalize(torch.randn(b, dim), dim=-1).requires_grad_()
                y = F.normalize(torch.randn(b, dim), dim=-1).requires_grad_()
                t0 = time.perf_counter()
                out = mod(image_features=x, text_features=y, logit_scale=torch.tensor(14.3), step=i)
                total_of(out).backward()
                if i:  # the first call clusters
                    ts.append(time.perf_counter() - t0)
            res[b][name] = round(median(ts) * 1000, 1)
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs/tiny/regions.yaml"))
    p.add_argument("--data", default=str(ROOT / "data/openmoji/train"))
    p.add_argument("--steps", type=int, default=20, help="steps per timed block")
    p.add_argument("--repeats", type=int, default=4, help="timed blocks per side (after one discarded)")
    p.add_argument("--scales", type=int, nargs="+", default=[5, 10, 20])
    p.add_argument("--batch-size", type=int, default=128)
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not Path(args.data).is_dir():
        print(f"error: {args.data} not found; run `make demo` (or data_tools build demo:openmoji) first",
              file=sys.stderr)
        return 2
    import torch

    from mmpretrain.config import load_config
    from mmpretrain.train import setup, train_step

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(args.config, [f"data.train={args.data}", f"data.batch_size={args.batch_size}",
                                        "train.epochs=null", "train.steps=100000", "train.progress=false"])
        term = next(t for t in cfg.loss if t.name == "regions")
        options = dict(term.options, scales=args.scales, warmup_steps=0, warmup_epochs=0)
        region_cfg = cfg.model_copy(update={"run_dir": f"{tmp}/regions",
                                            "loss": [term.model_copy(update={"options": options})]})
        base = {"name": options.get("base", "clip"), "weight": 1.0, "options": options.get("base_options", {})}
        plain_cfg = cfg.model_copy(update={"run_dir": f"{tmp}/plain", "loss": [type(term)(**base)]})
        runs = {"plain": setup(plain_cfg), "regions": setup(region_cfg)}
        iters = {k: iter(r.loader) for k, r in runs.items()}

        def block(name: str) -> float:
            run, it = runs[name], iters[name]
            t0 = time.perf_counter()
            for _ in range(args.steps):
                train_step(run, next(it))
                run.state.step += 1
                run.state.samples += run.schedule.global_batch_size
            return (time.perf_counter() - t0) / args.steps

        times: dict[str, list[float]] = {"plain": [], "regions": []}
        for i in range(args.repeats + 1):
            for name in ("plain", "regions") if i % 2 == 0 else ("regions", "plain"):
                t = block(name)
                if i:
                    times[name].append(t)
        active = runs["regions"].objective.terms[0].clustered
    objective_ms = objective_only(options, args.scales)
    ratios = [r / b for r, b in zip(times["regions"], times["plain"])]
    rows = [(i + 1, f"{b * 1000:.0f}", f"{r * 1000:.0f}", f"{q:.3f}")
            for i, (b, r, q) in enumerate(zip(times["plain"], times["regions"], ratios))]
    print(table(rows, ("block", "plain ms/step", "regions ms/step", "ratio")))
    extra = {"scales": args.scales, "batch_size": args.batch_size, "steps_per_block": args.steps,
             "config": str(Path(args.config).relative_to(ROOT)) if Path(args.config).is_relative_to(ROOT)
             else args.config, "refresh_every": options.get("refresh_every", 100),
             "plain_ms_per_step": round(median(times["plain"]) * 1000, 1),
             "regions_ms_per_step": round(median(times["regions"]) * 1000, 1), "regions_active": active,
             "objective_only_ms": objective_ms}
    print("objective alone (forward + backward, D = 512, no refresh), ms: "
          + ", ".join(f"B={b}: plain {v['plain']}, regions {v['regions']}" for b, v in objective_ms.items()))
    path = write_result("regions", median(ratios), False, 1.10, ratios, extra)
    print(f"ratio {median(ratios):.3f} (regions / plain seconds per step, lower is better; target <= 1.10) -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
