"""Fine-tuning a model pretrained here on a shifted domain: full fine-tuning, LoRA and a locked image
tower, with seeds, and the WiSE-FT curve of the full fine-tune.

    python scripts/reports/experiment_finetune.py [--seeds 0 1 2] [--steps 150] [--out runs/experiment_finetune]

"Pretrained": the packaged tiny ViT with its trainable open_clip text transformer, trained on the
OpenMoji demo split (``data/openmoji``, ``make demo`` builds it) with CLIP for --pretrain-steps.
Shifted domain: MNIST digits (``demo:mnist``, built into OUT/data/mnist: 4,000 training digits with
their captions, 1,000 held out). Each method fine-tunes the pretrained weights on MNIST's training
split for --steps steps (CLIP, batch 64, lr 1e-4, 10 warm-up steps, cosine) with each seed:

- ``full``: every weight trains;
- ``lora``: ``model.lora={rank: 8, towers: [image, text], modules: [mlp]}`` (adapters only), at the same
  rate and at ten times it (``lora_lr1e-3``: adapters start at zero and are usually trained faster);
- ``locked_image``: ``model.lock_image=true`` (the text tower and projections train).

Each run is evaluated on MNIST's held-out digits (zero-shot over the 10 digits: in domain) and on
OpenMoji's held-out split (zero-shot over its 16 keyword classes and image retrieval: the original
domain), and the full fine-tunes along WiSE-FT's alpha in {0, 0.25, 0.5, 0.75, 1}. Also recorded:
trained parameters (from the optimizer state), the training process's peak resident memory (every
loader in-process: a CPU stand-in for device memory) and its samples/s. A difference against ``full``
is marked * when |Δ| > 2·sqrt(sd_a²/n + sd_b²/n) over the n seeds (the evidence generator's rule).
Writes OUT/experiment.json and prints the markdown tables.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODEL = ["model.arch=mmpt-tiny-vit", "model.lock_text=false", "model.text_from_targets=false", "loss=[{name: clip}]",
         "data.num_workers=0", "data.batch_size=64", "train.log_with=[]", "train.progress=false",
         "train.epochs=null", "train.log_every=10", "train.keep_last=1", "train.diagnostics_every=null"]
LORA = "model.lora={rank: 8, alpha: 16, towers: [image, text], modules: [mlp]}"
METHODS = {"full": [], "lora": [LORA], "lora_lr1e-3": [LORA, "optim.lr=1e-3"], "locked_image": ["model.lock_image=true"]}
ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)
METRICS = {"mnist/acc1": "MNIST acc1 (in domain)", "openmoji/acc1": "OpenMoji acc1 (original)",
           "openmoji/image_retrieval_recall@5": "OpenMoji image R@5 (original)"}
# the training process, in-process loaders, reporting its peak resident memory when it ends
TRAIN = ("import resource, runpy, sys; sys.argv = ['mmpretrain.train'] + sys.argv[1:]\n"
         "try:\n    runpy.run_module('mmpretrain.train', run_name='__main__')\n"
         "finally:\n    print('peak_rss_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)")


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-3000:]}")
    return r


def train(run_dir: Path, data: Path, steps: int, seed: int, extra: list[str]) -> dict:
    """Train unless its final checkpoint exists; returns peak RSS (MiB) and samples/s of the run."""
    info = run_dir / "train_info.json"
    if info.is_file():
        return json.loads(info.read_text())
    r = run([sys.executable, "-c", TRAIN, "--config", str(ROOT / "configs/tiny/clip.yaml"), f"run_dir={run_dir}",
             f"data.train={data}", f"train.steps={steps}", f"seed={seed}", *MODEL, *extra])
    peak = int(next(x.split()[1] for x in r.stderr.splitlines() if x.startswith("peak_rss_kib")))
    final = json.loads(r.stdout.strip().splitlines()[-1])["final"]
    out = {"peak_rss_mib": round(peak / 1024, 1), "samples_per_s": round(final["samples_per_s"], 1)}
    info.write_text(json.dumps(out))
    return out


def trained_parameters(run_dir: Path) -> int:
    import torch

    ckpt = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    state = torch.load(ckpt / "optimizer.bin", map_location="cpu", weights_only=True)["state"]
    return sum(s["exp_avg"].numel() for s in state.values())


def evaluate(model: Path, mnist: Path, openmoji: Path, out: Path, *extra: str) -> list[dict]:
    if not out.is_file():
        run([sys.executable, "-m", "mmpretrain.eval", "--model", str(model), "--dataset", str(mnist), str(openmoji),
             str(openmoji), "--task", "zeroshot_classification", "zeroshot_classification", "zeroshot_retrieval",
             "--num_workers", "0", "--output", str(out), *extra])
    return json.loads(out.read_text())["results"]


def metrics_of(entries: list[dict]) -> dict[str, float]:
    out = {}
    for e in entries:
        domain = "mnist" if e["dataset"].startswith("mnist") else "openmoji"
        for k, v in e["metrics"].items():
            out[f"{domain}/{k}"] = v
    return out


def cell(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {sd:.3f}"


def delta(values: list[float], ref: list[float]) -> str:
    n = len(values)
    d = statistics.mean(values) - statistics.mean(ref)
    sd = lambda v: statistics.stdev(v) if len(v) > 1 else 0.0  # noqa: E731
    bound = 2 * math.sqrt(sd(values) ** 2 / n + sd(ref) ** 2 / n)
    return f"{d:+.3f}{'*' if abs(d) > bound else ''}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--pretrain-steps", type=int, default=180)
    p.add_argument("--out", default=str(ROOT / "runs/experiment_finetune"))
    args = p.parse_args()
    out, openmoji = Path(args.out), ROOT / "data/openmoji"
    if not (openmoji / "train/sizes.json").is_file():
        sys.exit("error: data/openmoji is missing: run `make demo` first")
    mnist = out / "data/mnist"
    if not (mnist / "train/sizes.json").is_file():
        run([sys.executable, "-m", "data_tools", "build", "demo:mnist", "--out", str(mnist), "--overwrite"])
    pre = out / "pretrained"
    pre_info = train(pre, openmoji / "train", args.pretrain_steps, 0, ["optim.lr=1e-3", "optim.warmup_steps=20"])
    result: dict = {"steps": args.steps, "pretrain_steps": args.pretrain_steps, "seeds": args.seeds,
                    "pretrained": {"metrics": metrics_of(evaluate(pre, mnist, openmoji, pre / "eval.json")),
                                   **pre_info}, "methods": {}}
    for method, extra in METHODS.items():
        rows = []
        for seed in args.seeds:
            d = out / f"{method}_s{seed}"
            info = train(d, mnist / "train", args.steps, seed, [f"model.pretrained={pre}", "optim.lr=1e-4",
                                                               "optim.warmup_steps=10", *extra])
            m = metrics_of(evaluate(d, mnist, openmoji, d / "eval.json"))
            row = {"seed": seed, "metrics": m, "trained_parameters": trained_parameters(d), **info}
            if method == "full":
                sweep = evaluate(d, mnist, openmoji, d / "wise_ft.json", "--interpolate", str(pre), "--alpha",
                                 *map(str, ALPHAS))
                row["wise_ft"] = {str(a): metrics_of([e for e in sweep if e["wise_ft"]["alpha"] == a]) for a in ALPHAS}
            rows.append(row)
            print(f"{method} seed {seed}: " + ", ".join(f"{k} {m[k]:.3f}" for k in METRICS), flush=True)
        result["methods"][method] = rows
    (out / "experiment.json").write_text(json.dumps(result, indent=2))
    print(tables(result))
    return 0


def tables(result: dict) -> str:
    full = result["methods"]["full"]
    pre = result["pretrained"]
    lines = ["| method | " + " | ".join(METRICS.values()) + " | trained parameters | peak RSS (MiB) | samples/s |",
             "|---|" + "---|" * (len(METRICS) + 3)]
    lines.append("| pretrained (OpenMoji), no fine-tune | " + " | ".join(f"{pre['metrics'][k]:.3f}" for k in METRICS)
                 + " | – | – | – |")
    for method, rows in result["methods"].items():
        vals = {k: [r["metrics"][k] for r in rows] for k in METRICS}
        ref = {k: [r["metrics"][k] for r in full] for k in METRICS}
        cells = [cell(vals[k]) + ("" if method == "full" else f" ({delta(vals[k], ref[k])})") for k in METRICS]
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {rows[0]['trained_parameters']:,} | "
                     f"{statistics.mean(r['peak_rss_mib'] for r in rows):,.0f} | "
                     f"{statistics.mean(r['samples_per_s'] for r in rows):.0f} |")
    lines += ["", "| WiSE-FT alpha (full fine-tune) | " + " | ".join(METRICS.values()) + " |",
              "|---|" + "---|" * len(METRICS)]
    for a in ALPHAS:
        lines.append(f"| {a:g} | " + " | ".join(cell([r["wise_ft"][str(a)][k] for r in full]) for k in METRICS) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
