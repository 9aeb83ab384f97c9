"""CLIP against CLIP + hard-negative captions (NegCLIP's columns) on the OpenMoji bed, with seeds.

    python scripts/reports/experiment_negatives.py [--seeds 0 1 2] [--steps 300] [--out runs/experiment_negatives]

Data: the OpenMoji demo split (``data/openmoji``, ``make demo`` builds it). ``data_tools negatives``
writes a copy of its training shards with rule-made negatives (seed 0: a swap of two content words and
a replacement of one by another caption's word, per caption where the rule applies); both methods
train on that copy, the baseline ignoring the negatives. The compositional test set is SugarCrepe's
layout built by the same rules from the held-out emoji (``--layout sugar_crepe``, seed 1): its
``swap_obj`` and ``replace_obj`` splits are rule-made stand-ins, **in distribution** for the
hard-negative run (it trained on negatives of exactly these kinds), not SugarCrepe's data.

Model: the packaged tiny ViT with its trainable open_clip text transformer (the negatives need a text
tower; the demo's frozen MiniLM-from-targets setting has none), CLIP, batch 64, lr 1e-3, 20 warm-up
steps, cosine, --steps steps, each seed. Evaluated: image-caption selection accuracy on both splits,
zero-shot acc1 over the 16 keyword classes, image and text retrieval R@5 on the held-out split, and
the training samples/s (the negatives double the text tower's batch). A difference is marked * when
|Δ| > 2·sqrt(sd_a²/n + sd_b²/n) over the n seeds (the evidence generator's rule). Writes
OUT/experiment.json and prints the markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from experiment_finetune import cell, delta, run  # a sibling: the evidence generator's rule, one copy

ROOT = Path(__file__).resolve().parents[2]
MODEL = ["model.arch=mmpt-tiny-vit", "model.lock_text=false", "model.text_from_targets=false",
         "data.num_workers=0", "data.batch_size=64", "train.log_with=[]", "train.progress=false",
         "train.epochs=null", "train.log_every=20", "train.keep_last=1", "train.diagnostics_every=null",
         "optim.lr=1e-3", "optim.warmup_steps=20"]
METHODS = {"clip": ["loss=[{name: clip}]"],
           "clip + hard negatives": ["loss=[{name: clip, options: {hard_negatives: true}}]"]}
METRICS = {"sugar_crepe/swap_obj/acc": "swap acc", "sugar_crepe/replace_obj/acc": "replace acc",
           "openmoji/acc1": "zero-shot acc1", "openmoji/image_retrieval_recall@5": "image R@5",
           "openmoji/text_retrieval_recall@5": "text R@5"}


def train(run_dir: Path, data: Path, steps: int, seed: int, extra: list[str]) -> dict:
    info = run_dir / "train_info.json"
    if info.is_file():
        return json.loads(info.read_text())
    r = run([sys.executable, "-m", "mmpretrain.train", "--config", str(ROOT / "configs/tiny/clip.yaml"),
             f"run_dir={run_dir}", f"data.train={data}", f"train.steps={steps}", f"seed={seed}", *MODEL, *extra])
    final = json.loads(r.stdout.strip().splitlines()[-1])["final"]
    out = {"samples_per_s": round(final["samples_per_s"], 1), "skipped": final.get("skipped", {})}
    info.write_text(json.dumps(out))
    return out


def evaluate(model: Path, sugar_crepe: Path, openmoji: Path, out: Path) -> dict[str, float]:
    if not out.is_file():
        run([sys.executable, "-m", "mmpretrain.eval", "--model", str(model), "--dataset", f"sugar_crepe:{sugar_crepe}",
             str(openmoji), str(openmoji / "test"), "--task", "image_caption_selection", "zeroshot_classification",
             "zeroshot_retrieval", "--recall_k", "1", "5", "--num_workers", "0", "--output", str(out)])
    metrics = {}
    for e in json.loads(out.read_text())["results"]:
        prefix = e["dataset"] if e["dataset"].startswith("sugar_crepe") else "openmoji"
        metrics.update({f"{prefix}/{k}": v for k, v in e["metrics"].items()})
    return metrics


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--out", default=str(ROOT / "runs/experiment_negatives"))
    args = p.parse_args()
    out, openmoji = Path(args.out), ROOT / "data/openmoji"
    if not (openmoji / "train/sizes.json").is_file():
        sys.exit("error: data/openmoji is missing: run `make demo` first")
    data, sugar_crepe = out / "data/train_negatives", out / "data/sugar_crepe"
    made = {}
    if not (data / "sizes.json").is_file():
        made["train"] = json.loads(run([sys.executable, "-m", "data_tools", "negatives", str(openmoji / "train"),
                                        "--out", str(data), "--seed", "0"]).stdout)
    if not (sugar_crepe / "swap_obj.json").is_file():
        made["test"] = json.loads(run([sys.executable, "-m", "data_tools", "negatives", str(openmoji / "test"),
                                       "--out", str(sugar_crepe), "--layout", "sugar_crepe", "--seed", "1"]).stdout)
    result: dict = {"steps": args.steps, "seeds": args.seeds, "data": made, "methods": {}}
    for method, extra in METHODS.items():
        rows = []
        for seed in args.seeds:
            d = out / f"{method.replace(' + ', '_').replace(' ', '_')}_s{seed}"
            info = train(d, data, args.steps, seed, extra)
            m = evaluate(d, sugar_crepe, openmoji, d / "eval.json")
            rows.append({"seed": seed, "metrics": m, **info})
            print(f"{method} seed {seed}: " + ", ".join(f"{v} {m[k]:.3f}" for k, v in METRICS.items()), flush=True)
        result["methods"][method] = rows
    (out / "experiment.json").write_text(json.dumps(result, indent=2))
    print(table(result))
    return 0


def table(result: dict) -> str:
    base = result["methods"]["clip"]
    lines = ["| method | " + " | ".join(METRICS.values()) + " | samples/s |", "|---|" + "---|" * (len(METRICS) + 1)]
    for method, rows in result["methods"].items():
        cells = [cell([r["metrics"][k] for r in rows])
                 + ("" if rows is base else f" ({delta([r['metrics'][k] for r in rows], [r['metrics'][k] for r in base])})")
                 for k in METRICS]
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {statistics.mean(r['samples_per_s'] for r in rows):.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
