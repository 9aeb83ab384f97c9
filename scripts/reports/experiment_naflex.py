"""What NaFlex buys on the packaged emoji, with seeds: one model trained over several sequence lengths
against fixed-length models trained at each, every model evaluated at every length; and the mixed model on
the held-out emoji stretched to 2:1 and 1:2, at native aspect ratio against their square centre crops.

    python scripts/reports/experiment_naflex.py [--seeds 0 1 2] [--lengths 4 16 36] [--epochs 10 | --steps 90]
                                                [--data data/openmoji] [--work runs/experiments/naflex]

``--epochs``: every model sees the same samples (a fixed-36 model then takes 9x the steps of a fixed-4 one);
``--steps``: the same steps, so the same patches at 1,024 a step (about the same compute).

Every model is configs/tiny/naflex.yaml (the tiny NaFlexVit, sigmoid, 1,024 patches per step) with only
data.naflex.seq_lens changed and the seed; zero-shot top-1 on the held-out split through
``python -m mmpretrain.eval --naflex-seq-len``. The square emoji keep their 32 px square shape at every
length, so a fixed-length model here is the fixed-resolution model at that length's grid. Writes
bench_results/experiments/naflex.json and .md: mean ± sd over seeds, a difference marked * when
|Δ| > 2·sqrt(sd_a²/n + sd_b²/n).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def sh(*cmd: str) -> str:
    r = subprocess.run([sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True, env=ENV)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd[:3])} failed:\n{r.stderr[-3000:]}")
    return r.stdout


def reshaped(src: Path, dst: Path, size: tuple[int, int], crop: bool) -> Path:
    """A copy of the evaluation folder ``src`` with every image resized to ``size`` (w, h); ``crop``: then
    centre-cropped to a square of its short side."""
    if dst.is_dir():
        return dst
    # a fresh folder of ours beside dst (deleting nothing: an interrupted copy leaves only its own .tmp folder)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)) / "copy"
    shutil.copytree(src, tmp)
    for tar in tmp.glob("*.tar"):
        out = tar.with_suffix(".new")
        with tarfile.open(tar) as t, tarfile.open(out, "w") as w:
            for m in t.getmembers():
                data = t.extractfile(m).read()
                if m.name.endswith((".png", ".jpg")):
                    img = Image.open(io.BytesIO(data)).convert("RGB").resize(size, Image.BICUBIC)
                    if crop:
                        s = min(size)
                        left, top = (size[0] - s) // 2, (size[1] - s) // 2
                        img = img.crop((left, top, left + s, top + s))
                    buf = io.BytesIO()
                    img.save(buf, "PNG")
                    data = buf.getvalue()
                m.size = len(data)
                w.addfile(m, io.BytesIO(data))
        out.replace(tar)
    tmp.rename(dst)
    tmp.parent.rmdir()  # the now empty folder mkdtemp made
    return dst


def acc1(model: Path, dataset: Path, lengths: list[int]) -> dict[int, float]:
    out = model.parent / f"eval_{dataset.name}.json"
    if not out.is_file():
        sh("-m", "mmpretrain.eval", "--model", str(model), "--dataset", str(dataset), "--task",
           "zeroshot_classification", "--naflex-seq-len", *map(str, lengths), "--num_workers", "0",
           "--output", str(out))
    entries = json.loads(out.read_text())["results"]
    return {int(e["model"].rsplit("@", 1)[1]): e["metrics"]["acc1"] for e in entries}


def train(work: Path, lens: list[int], seed: int, epochs: int | None, data: Path, steps: int | None = None) -> Path:
    run = work / (f"{'-'.join(map(str, lens))}_s{seed}" + (f"_steps{steps}" if steps else "")) / "run"
    if not (run / "done").is_file():  # an interrupted run resumes from its own latest checkpoint
        sh("-m", "mmpretrain.train", "--config", "configs/tiny/naflex.yaml", f"run_dir={run}", f"seed={seed}",
           f"data.train={data / 'train'}", f"data.naflex={{seq_lens: {lens}, max_tokens_per_batch: 1024}}",
           *([f"train.steps={steps}", "train.epochs=null"] if steps else [f"train.epochs={epochs}"]),
           "train.progress=false", "train.plots=false", "train.log_with=[]")
        (run / "done").write_text("")
    return run


def cell(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"


def delta(a: list[float], b: list[float]) -> str:
    d = statistics.mean(a) - statistics.mean(b)
    bound = 2 * math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b)) if len(a) > 1 else math.inf
    return f"{d:+.3f}{' *' if abs(d) > bound else ''} (bound {bound:.3f})"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--lengths", type=int, nargs="+", default=[4, 16, 36])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--steps", type=int, default=None, help="the same steps for every model (instead of --epochs)")
    p.add_argument("--data", default=str(ROOT / "data/openmoji"))
    p.add_argument("--work", default=str(ROOT / "runs/experiments/naflex"))
    args = p.parse_args()
    data, work, L = Path(args.data), Path(args.work), args.lengths
    work.mkdir(parents=True, exist_ok=True)
    test = data / "test"
    shapes = {"wide 2:1": reshaped(test, work / "test_wide", (64, 32), False),
              "wide 2:1, square crop": reshaped(test, work / "test_wide_crop", (64, 32), True),
              "tall 1:2": reshaped(test, work / "test_tall", (32, 64), False),
              "tall 1:2, square crop": reshaped(test, work / "test_tall_crop", (32, 64), True)}
    models = {"mixed " + "/".join(map(str, L)): L, **{f"fixed {n}": [n] for n in L}}
    res: dict[str, dict] = {}
    for name, lens in models.items():
        runs = [train(work, lens, s, args.epochs, data, args.steps) for s in args.seeds]
        res[name] = {n: [acc1(r, test, L)[n] for r in runs] for n in L}
        if name.startswith("mixed"):
            res["aspect"] = {k: [acc1(r, ds, [max(L)])[max(L)] for r in runs] for k, ds in shapes.items()}
    mixed = next(k for k in models if k.startswith("mixed"))
    budget = f"{args.steps} steps of 1,024 patches" if args.steps else f"{args.epochs} epochs"
    lines = [f"Zero-shot top-1 on the held-out emoji ({len(args.seeds)} seeds, {budget}; * : |Δ| > "
             "2·sqrt(sd_a²/n + sd_b²/n))", "", "| model | " + " | ".join(f"eval at {n}" for n in L) + " |",
             "|---|" + "---|" * len(L)]
    for name in models:
        lines.append(f"| {name} | " + " | ".join(cell(res[name][n]) for n in L) + " |")
    lines.append("| Δ mixed − fixed at that length | " + " | ".join(delta(res[mixed][n], res[f'fixed {n}'][n])
                                                                       for n in L) + " |")
    a = res["aspect"]
    lines += ["", f"The mixed model at {max(L)} patches on stretched emoji: native aspect against square centre crops",
              "", "| images | native | square crop | Δ |", "|---|---|---|---|"]
    for k in ("wide 2:1", "tall 1:2"):
        lines.append(f"| {k} | {cell(a[k])} | {cell(a[k + ', square crop'])} | {delta(a[k], a[k + ', square crop'])} |")
    text = "\n".join(lines) + "\n"
    out = ROOT / "bench_results/experiments"
    out.mkdir(parents=True, exist_ok=True)
    name = f"naflex_steps{args.steps}" if args.steps else "naflex"
    (out / f"{name}.json").write_text(json.dumps({"seeds": args.seeds, "epochs": args.epochs, "steps": args.steps,
                                                  "results": res}, indent=2) + "\n")
    (out / f"{name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
