"""Region weighting on the packaged data: with and without regions at equal steps, held-out metrics,
plots of the weights' entropy and the regions' purity over training.

    python scripts/reports/experiment_regions.py [--config configs/tiny/regions.yaml] [--out runs/experiment_regions]
                                         [--seeds 0] [--variants plain image target] [-- OVERRIDES...]

Each variant trains ``--config`` through ``python -m mmpretrain.train`` with the same model, data,
optimiser, seed and number of steps; only the objective differs: ``plain`` is the base objective
(CLIP), ``image`` / ``target`` the region-weighted one clustering in image / caption-embedding
space. Every run is then evaluated on the held-out OpenMoji split (zero-shot classification over its
keyword classes and retrieval) with ``python -m mmpretrain.eval``. Writes OUT/experiment.json (every
metric per variant and seed), OUT/plots/q_entropy.png (entropy of each scale's weights over steps,
its maximum log m dashed) and OUT/plots/purity.png (share of labelled batch samples carrying their
region's majority label, per scale; the warm-up half is global-only, so the plot shows purity before
and after the regions take part in the loss). Data: ``make demo`` builds data/openmoji.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
METRICS = ("acc1", "acc5", "mean_per_class_recall", "image_retrieval_recall@5", "text_retrieval_recall@5")


def train_and_eval(cfg: str, run: Path, data: Path, overrides: list[str]) -> dict:
    if not (run / "results.json").is_file():
        cmd = [sys.executable, "-m", "mmpretrain.train", "--config", cfg, f"run_dir={run}", f"data.train={data / 'train'}",
               "train.progress=false", *overrides]
        subprocess.run(cmd, check=True, cwd=ROOT)
        subprocess.run([sys.executable, "-m", "mmpretrain.eval", "--model", str(run), "--dataset", str(data),
                        str(data / "test"), "--task", "zeroshot_classification", "zeroshot_retrieval",
                        "--output", str(run / "results.json")], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    metrics = {}
    for entry in json.loads((run / "results.json").read_text())["results"]:
        metrics.update({k: v for k, v in entry["metrics"].items() if k in METRICS})
    return metrics


def plot(records: dict[str, list[dict]], out: Path, scales: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import math

    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    for what, key, ylabel in (("q_entropy", "q_entropy", "entropy of q (nats)"),
                              ("purity", "purity", "region purity (labelled batch samples)")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for variant, recs in records.items():
            for m in scales:
                pts = [(r["step"], r[f"regions/m{m}/{key}"]) for r in recs if f"regions/m{m}/{key}" in r]
                if pts:
                    line, = ax.plot(*zip(*pts), label=f"{variant}, {m} regions")
                    if what == "q_entropy":
                        ax.axhline(math.log(m), color=line.get_color(), ls="--", lw=0.8)
        start = next((r["step"] for recs in records.values() for r in recs if r.get("regions/active") == 1), None)
        if start is not None:
            ax.axvline(start, color="grey", lw=0.8, ls=":", label="regions start")
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"{what}.png", dpi=120)
        plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny/regions.yaml")
    p.add_argument("--data", default=str(ROOT / "data/openmoji"))
    p.add_argument("--out", default=str(ROOT / "runs/experiment_regions"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--variants", nargs="+", default=["plain", "image"], choices=["plain", "image", "target"])
    p.add_argument("overrides", nargs="*", help="dotted config overrides for every run, e.g. train.epochs=10")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    data, out = Path(args.data), Path(args.out)
    if not (data / "train").is_dir() or not (data / "test").is_dir():
        print(f"error: {data}/train and {data}/test not found; run `make demo` first", file=sys.stderr)
        return 2
    from mmpretrain.config import load_config

    cfg = load_config(args.config, args.overrides)
    term = next((t for t in cfg.loss if t.name == "regions"), None)
    if term is None:
        print(f"error: {args.config} has no `regions` loss term", file=sys.stderr)
        return 2
    scales = list(term.options.get("scales", [5, 10, 20]))
    base = term.options.get("base", "clip")
    variant_overrides = {
        "plain": [f"loss=[{{name: {base}, options: {json.dumps(term.options.get('base_options', {}))}}}]"],
        "image": ["loss.0.options.space=image"],
        "target": ["loss.0.options.space=target"],
    }
    results: dict[str, dict[int, dict]] = {v: {} for v in args.variants}
    records: dict[str, list[dict]] = {}
    for seed in args.seeds:
        for variant in args.variants:
            run = out / f"{variant}_seed{seed}"
            results[variant][seed] = train_and_eval(args.config, run, data,
                                                    [*args.overrides, f"seed={seed}", *variant_overrides[variant]])
            if variant != "plain" and seed == args.seeds[0]:
                records[variant] = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    plot(records, out / "plots", scales)
    summary = {v: {m: statistics.mean(r[s][m] for s in r) for m in METRICS if all(m in r[s] for s in r)}
               for v, r in results.items()}
    (out / "experiment.json").write_text(json.dumps({"config": args.config, "overrides": args.overrides,
                                                     "seeds": args.seeds, "per_seed": results, "mean": summary},
                                                    indent=2) + "\n")
    names = [m for m in METRICS if all(m in summary[v] for v in summary)]
    print("variant  " + "  ".join(names))
    for v, vals in summary.items():
        print(f"{v:<8} " + "  ".join(f"{vals[m]:.3f}".ljust(len(m)) for m in names))
    print(f"-> {out / 'experiment.json'}, plots in {out / 'plots'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
