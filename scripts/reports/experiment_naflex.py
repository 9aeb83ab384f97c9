"""What NaFlex buys on an emoji bed, with seeds: one model trained over several sequence lengths against
fixed-length models trained at each, every model evaluated at every length; and the mixed model on the bed
stretched to 2:1 and 1:2, at native aspect ratio against their square centre crops.

    python scripts/reports/experiment_naflex.py [--seeds 0 1 2] [--lengths 4 16 36] [--epochs 10 | --steps 90]
                                                [--data data/openmoji] [--knn] [--work DIR]
    python scripts/reports/experiment_naflex.py --data data/openmoji-all --knn --steps 600   # make openmoji-all

``--epochs``: every model sees the same samples (a fixed-36 model then takes 9x the steps of a fixed-4 one);
``--steps``: the same steps, so the same patches at 1,024 a step (about the same compute). ``--knn``: also
k-NN top-1 (k = 20) with the bed's training split as the bank, for a bed whose zero-shot stays near chance;
a bed with a ``noto/`` folder (demo:openmoji-all's second style) is also evaluated zero-shot there.

Every model is configs/tiny/naflex.yaml (the tiny NaFlexVit, sigmoid, 1,024 patches per step) with only
data.naflex.seq_lens changed and the seed, evaluated through ``python -m mmpretrain.eval --naflex-seq-len``.
Square emoji keep their square shape at every length, so a fixed-length model is the fixed-resolution model
at that length's grid. Runs and the stretched copies of the bed go to runs/experiments/naflex (data/openmoji)
or naflex-NAME; writes bench_results/experiments/naflex[_NAME][_stepsN].json and .md: mean ± sd over seeds,
a difference marked * when |Δ| > 2·sqrt(sd_a²/n + sd_b²/n).
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
    for tar in tmp.rglob("*.tar"):
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


TASKS = {"zeroshot": ("zeroshot_classification", "acc1"), "knn": ("knn", "knn_acc1")}


def score(model: Path, key: str, dataset: Path, task: str, lengths: list[int]) -> dict[int, float]:
    """``task`` (a TASKS key) of run ``model`` on ``dataset`` at each length; cached in eval_KEY.json."""
    name, metric = TASKS[task]
    out = model.parent / f"eval_{key}.json"
    if not out.is_file():
        sh("-m", "mmpretrain.eval", "--model", str(model), "--dataset", str(dataset), "--task", name,
           "--naflex-seq-len", *map(str, lengths), "--num_workers", "0", "--output", str(out))
    entries = json.loads(out.read_text())["results"]
    return {int(e["model"].rsplit("@", 1)[1]): e["metrics"][metric] for e in entries}


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
    p.add_argument("--knn", action="store_true", help="also k-NN top-1 (for a bed whose zero-shot is near chance)")
    p.add_argument("--work", default=None, help="default runs/experiments/naflex (data/openmoji), else naflex-NAME")
    args = p.parse_args()
    data, L = Path(args.data), args.lengths
    tag = "" if data.resolve() == (ROOT / "data/openmoji").resolve() else f"_{data.name}"
    work = Path(args.work or ROOT / f"runs/experiments/naflex{tag.replace('_', '-')}")
    work.mkdir(parents=True, exist_ok=True)
    # every evaluation: (title, task, cache key, dataset); kNN uses the bed's train split as its bank
    evals = [("zero-shot top-1, held-out emoji", "zeroshot", "test", data / "test")]
    if args.knn:
        evals.append(("k-NN top-1 (k = 20, the train split as the bank), held-out emoji", "knn", "knn", data))
    if (data / "noto").is_dir():  # demo:openmoji-all's second drawing style: the held-out emoji drawn by Noto
        evals.append(("zero-shot top-1, the held-out emoji in the Noto style", "zeroshot", "noto", data / "noto"))
    # the bed stretched to 2:1 and 1:2 (train split too, for kNN's bank), native against square centre crops
    shapes = {f"{k}{c}": reshaped(data, work / f"{k.split()[0]}{c and '_crop'}", size, bool(c))
              for k, size in (("wide 2:1", (64, 32)), ("tall 1:2", (32, 64))) for c in ("", ", square crop")}
    aspect_evals = [("zeroshot", lambda d: d / "test")] + ([("knn", lambda d: d)] if args.knn else [])
    models = {"mixed " + "/".join(map(str, L)): L, **{f"fixed {n}": [n] for n in L}}
    res: dict[str, dict] = {}
    for name, lens in models.items():
        runs = [train(work, lens, s, args.epochs, data, args.steps) for s in args.seeds]
        for title, task, key, ds in evals:
            res.setdefault(title, {})[name] = {n: [score(r, key, ds, task, L)[n] for r in runs] for n in L}
        if name.startswith("mixed"):
            res["aspect"] = {task: {k: [score(r, f"{ds.name}_{task}", where(ds), task, [max(L)])[max(L)]
                                        for r in runs] for k, ds in shapes.items()} for task, where in aspect_evals}
    mixed = next(k for k in models if k.startswith("mixed"))
    budget = f"{args.steps} steps of 1,024 patches" if args.steps else f"{args.epochs} epochs"
    shown = data.relative_to(ROOT) if data.is_relative_to(ROOT) else data
    lines = [f"Data: {shown}; {len(args.seeds)} seeds, {budget}; * : |Δ| > 2·sqrt(sd_a²/n + sd_b²/n)"]
    for title, *_ in evals:
        r = res[title]
        lines += ["", title[0].upper() + title[1:], "", "| model | " + " | ".join(f"eval at {n}" for n in L) + " |",
                  "|---|" + "---|" * len(L)]
        lines += [f"| {name} | " + " | ".join(cell(r[name][n]) for n in L) + " |" for name in models]
        lines.append("| Δ mixed − fixed at that length | " + " | ".join(delta(r[mixed][n], r[f'fixed {n}'][n])
                                                                           for n in L) + " |")
    lines += ["", f"The mixed model at {max(L)} patches on the stretched bed: native aspect against square centre "
              "crops", "", "| images | metric | native | square crop | Δ |", "|---|---|---|---|---|"]
    for task, _ in aspect_evals:
        a = res["aspect"][task]
        for k in ("wide 2:1", "tall 1:2"):
            lines.append(f"| {k} | {TASKS[task][1]} | {cell(a[k])} | {cell(a[k + ', square crop'])} | "
                         f"{delta(a[k], a[k + ', square crop'])} |")
    text = "\n".join(lines) + "\n"
    out = ROOT / "bench_results/experiments"
    out.mkdir(parents=True, exist_ok=True)
    name = f"naflex{tag}" + (f"_steps{args.steps}" if args.steps else "")
    (out / f"{name}.json").write_text(json.dumps({"data": str(shown), "seeds": args.seeds, "epochs": args.epochs,
                                                  "steps": args.steps,
                                                  "results": res}, indent=2) + "\n")
    (out / f"{name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
