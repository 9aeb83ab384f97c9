"""What each objective buys, measured on held-out data with seeds: one command for the whole grid.

    python scripts/reports/experiment.py VARIANT... --data demo:mnist|demo:openmoji|demo:openmoji-all|DIR [--seeds 0 1 2]
                                 [--batch-sizes 64] [--steps 550] [--eval-every 110] [--input-size 32]
                                 [--out bench_results/experiments] [--work runs/experiments]

Every (variant, seed, batch size) cell trains the same model -- the packaged 32 px ViT with a
*trainable* tiny open_clip text transformer (so the soft targets carry information the text tower
does not already have; ``lit`` alone uses the frozen MiniLM tower) -- on the same data, steps and seed
through ``python -m mmpretrain.train``, with held-out zero-shot accuracy evaluated during training
(``eval.every``), then ``python -m mmpretrain.eval`` on the held-out split: zero-shot classification,
linear probe, k-NN and clustering (projected and pre-projection features), plus retrieval on OpenMoji
and zero-shot on scikit-learn's digits (out of domain) for MNIST. Each finished cell is written into
OUT/<data>.json at once, so an interrupted grid resumes where it stopped (a cell whose run folder
lacks its final results is retrained from scratch). Then OUT/<data>.md gets the table -- mean ± sd
over seeds, Δ vs ``clip`` at the same batch size, marked * when |Δ| > 2·sqrt(sd_v²/n + sd_clip²/n) --
and OUT/<data>_acc1.png the held-out accuracy over training per variant.

``--data demo:NAME`` builds and embeds the packaged dataset into WORK/data/NAME the first time
(``data_tools build`` + ``embed`` with MiniLM); a folder is used as it is (built and embedded).
Variants: """

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from mmpretrain.config.base import DEMO_TEXT_MODEL

ROOT = Path(__file__).resolve().parents[2]
MINILM = DEMO_TEXT_MODEL
NOTO = ROOT / ".cache/noto/emoji-datasource-google-16.0.0"  # `make noto`


from grid import (  # noqa: E402,F401
    CAPTION_VARIANTS,
    INPUT_SIZE,
    MODEL_OVERRIDES,
    REGION_WARMUP,
    STEPS,
    TABLE,
    TEACHER_CELLS,
    TEACHER_CROPS,
    TEACHER_OVERRIDES,
    TEACHER_STEPS,
    VARIANTS,
    distill,
    regions,
)

__doc__ += ", ".join(VARIANTS) + "."


def run_cli(*args: str, log: Path) -> None:
    with log.open("a") as f:
        r = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                           env={**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")})
    if r.returncode:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"error: python -m {' '.join(args[:2])} failed (exit {r.returncode}); {log}:\n{tail}")


def prepare_data(spec: str, work: Path) -> tuple[Path, str]:
    """The dataset folder and its name; a packaged one is built and embedded the first time."""
    if not spec.startswith("demo:"):
        folder = Path(spec)
        if not (folder / "train").is_dir() or not (folder / "test").is_dir():
            raise SystemExit(f"error: --data {folder}: no train/ and test/ (build one with data_tools build demo:...)")
        return folder, folder.name
    name = spec.split(":", 1)[1]
    if name not in ("mnist", "openmoji", "openmoji-all"):
        raise SystemExit(f"error: --data {spec}: use demo:mnist, demo:openmoji, demo:openmoji-all or a dataset folder")
    folder = work / "data" / name
    if not (folder / "train" / "embeddings.json").is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        log = work / "data" / f"{name}.log"
        # openmoji-all: shards at 64 px (skin tones and hair legible), its Noto style when `make noto` fetched it
        size = "64" if name == "openmoji-all" else "32"
        style = ["--second-style", str(NOTO)] if name == "openmoji-all" and NOTO.is_dir() else []
        run_cli("data_tools", "build", spec, "--out", str(folder), "--image-size", size, "--shard-size", "250",
                "--overwrite", *style, log=log)
        run_cli("data_tools", "embed", str(folder), "--model", MINILM, log=log)
    return folder, name


def cell_config(variant: str, seed: int, batch: int, args, data: Path, run: Path) -> dict:
    cfg = {
        "name": f"{variant}_s{seed}_b{batch}", "seed": seed, "run_dir": str(run),
        "data": {"train": str(data / "train"), "batch_size": batch, "num_workers": 2, "shuffle_buffer": 500},
        "model": {"arch": "mmpt-tiny-vit", "overrides": MODEL_OVERRIDES},
        "targets": {"model": MINILM, "source": "shards"},
        "optim": {"lr": 1e-3, "weight_decay": 0.1, "warmup_steps": max(1, args.steps // 10)},
        "train": {"steps": args.steps, "epochs": None, "log_every": 10, "progress": False, "log_with": [],
                  "diagnostics_every": args.eval_every},
        "eval": {"every": args.eval_every, "datasets": [str(data)], "tasks": ["zeroshot_classification"],
                 "num_workers": 1},
    }
    spec = dict(VARIANTS[variant](args.steps))
    teacher = spec.pop("teacher", None)
    for key, value in spec.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) else value
    if teacher is not None:  # the distill variants: the teacher's rows, at its own scale (its teachers.json)
        folder = teacher_folder(data, teacher)
        if folder != data / "train":  # its own folder: the caption rows are not needed (no term uses them)
            cfg["data"]["embeddings"] = str(folder)
            cfg["targets"]["source"] = "auto"
        block = next(iter(json.loads((folder / "teachers.json").read_text())["teachers"].values()))
        for term in cfg["loss"]:
            if term.get("options", {}).get("teacher_scale") == "TEACHER_SCALE":
                term["options"]["teacher_scale"] = block["logit_scale"]
    size = getattr(args, "input_size", INPUT_SIZE)
    if size != INPUT_SIZE:
        overrides = cfg["model"]["overrides"]
        cfg["model"]["overrides"] = {**overrides, "vision_cfg": {**overrides["vision_cfg"], "image_size": size,
                                                                 "patch_size": size // 4}}
    return cfg


HELDOUT_TASKS = ("zeroshot_classification", "linear_probe", "knn", "clustering")


def final_eval(run: Path, data: Path, name: str, tasks: list[str], caption: bool = False,
               dense_set: str | None = None) -> dict[str, float]:
    jobs = [("heldout", str(data), t) for t in tasks]
    if (data / "digits").is_dir() and "zeroshot_classification" in tasks:
        jobs.append(("digits", str(data / "digits"), "zeroshot_classification"))
    if (data / "test").is_dir() and name.startswith("openmoji") and "zeroshot_retrieval" not in tasks:
        jobs.append(("retrieval", str(data / "test"), "zeroshot_retrieval"))
    if (data / "noto").is_dir() and "zeroshot_classification" in tasks:  # the second drawing style
        jobs += [("cross_style", str(data / "noto"), "zeroshot_classification"),
                 ("cross_style_retrieval", str(data / "noto"), "zeroshot_retrieval")]
    dense = Path(dense_set) if dense_set else data / "dense"
    if dense.is_dir():  # the patch tokens' linear probe (per-patch labels: data_tools' dense sets)
        jobs.append(("dense", str(dense), "dense_probe"))
    generation = []
    if caption:  # a CoCa cell: its captions of the held-out emoji (names of 1-4 words: no 4-token minimum)
        jobs.append(("captioning", str(data / "test"), "captioning"))
        generation = ["--num-beams", "3", "--max-caption-len", "16", "--min-caption-len", "2"]
    out = run / "final_results.json"  # the run folder is new (train_cell): nothing to replace
    run_cli("mmpretrain.eval", "--model", str(run), "--dataset", *[j[1] for j in jobs], "--task", *[j[2] for j in jobs],
            "--num_workers", "1", "--output", str(out), *generation, log=run / "experiment.log")
    entries = json.loads(out.read_text())["results"]
    metrics: dict[str, float] = {}
    for (label, _, _), entry in zip(jobs, entries):
        metrics.update({f"{label}/{k}": v for k, v in entry["metrics"].items() if isinstance(v, (int, float))})
    return metrics


def cell_dir(work: Path, name: str, variant: str, seed: int, batch: int, steps: int) -> Path:
    """A cell's run folder: a grid of another length gets its own folders beside the default grid's (and
    reuses its built data)."""
    return work / name / (f"{variant}_s{seed}_b{batch}" + ("" if steps == STEPS else f"_{steps}steps"))


def train_cell(variant: str, seed: int, batch: int, args, data: Path, name: str, work: Path) -> dict:
    run = cell_dir(work, name, variant, seed, batch, args.steps)
    spec = run.parent / f"{run.name}.yaml"
    config = cell_config(variant, seed, batch, args, data, run)
    if run.exists():  # unfinished (finished cells are in the JSON): start it again -- if this script made it
        if not spec.is_file():
            raise SystemExit(f"error: {run} exists but this script did not make it (no {spec.name} beside it); "
                             "pass another --work")
        # another grid's cell (other settings, or finished but not in this --out's JSON): never replaced
        if yaml.safe_load(spec.read_text()) != config or (run / "final_results.json").is_file():
            raise SystemExit(f"error: {run} is a cell of another grid ({spec} differs from this one's config, or "
                             "the cell finished and is not in this --out's JSON); pass another --work")
        import shutil

        shutil.rmtree(run)
    run.mkdir(parents=True)
    spec.write_text(yaml.safe_dump(config))
    t0 = time.time()
    run_cli("mmpretrain.train", "--config", str(spec), log=run / "experiment.log")
    seconds = time.time() - t0
    records = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines() if x.strip()]
    key = next((k for r in records for k in r if k.startswith("eval/") and k.endswith("/acc1")), None)
    curve = [[r["step"], r[key]] for r in records if key and key in r]
    last = next((r for r in reversed(records) if any(k.startswith("geometry/") for k in r)), {})
    geometry = {k.removeprefix("geometry/"): v for k, v in last.items() if k.startswith("geometry/")}
    # region diagnostics per logged step (region variants log them once their bank is clustered):
    # purity, and how far Hedge moved each scale's weights (q_entropy, q_max)
    regions_curve = [[r["step"], {k.removeprefix("regions/"): v for k, v in r.items() if k.startswith("regions/m")
                                  and k.rsplit("/", 1)[1] in ("purity", "q_entropy", "q_max")}]
                     for r in records if any(k.endswith("/purity") for k in r)]
    final_loss = next((r["loss"] for r in reversed(records) if "loss" in r), None)
    epochs = next((r["epoch"] for r in reversed(records) if "epoch" in r), None)  # passes over the training data
    return {"variant": variant, "seed": seed, "batch_size": batch, "steps": args.steps, "epochs": epochs,
            "train_seconds": round(seconds, 1), "curve": curve,
            "metrics": final_eval(run, data, name, args.tasks, variant in CAPTION_VARIANTS, getattr(args, "dense", None)),
            "geometry": geometry, "regions": regions_curve, "final_loss": final_loss, "tasks": args.tasks}


def summarize(cells: dict[str, dict]) -> tuple[list[dict], str]:
    """Rows of mean, sd and Δ vs clip per (variant, batch size, metric), and the markdown table."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for c in cells.values():
        groups.setdefault((c["variant"], c["batch_size"]), []).append(c)
    rows = []
    for (variant, batch), cs in sorted(groups.items(), key=lambda kv: (kv[0][1], list(VARIANTS).index(kv[0][0])
                                                                      if kv[0][0] in VARIANTS else 99, kv[0][0])):
        for metric in TABLE:
            vals = [c["metrics"][metric] for c in cs if metric in c["metrics"]]
            if not vals:
                continue
            row = {"variant": variant, "batch_size": batch, "metric": metric, "n": len(vals),
                   "mean": statistics.fmean(vals), "sd": statistics.stdev(vals) if len(vals) > 1 else 0.0}
            ref = [c["metrics"][metric] for c in groups.get(("clip", batch), []) if metric in c["metrics"]]
            if ref and variant != "clip":
                sd_ref = statistics.stdev(ref) if len(ref) > 1 else 0.0
                row["delta"] = row["mean"] - statistics.fmean(ref)
                bound = 2 * math.sqrt(row["sd"] ** 2 / len(vals) + sd_ref ** 2 / len(ref))
                row["significant"] = len(vals) > 1 and len(ref) > 1 and abs(row["delta"]) > bound
            rows.append(row)
    metrics = [m for m in TABLE if any(r["metric"] == m for r in rows)]
    lines = ["| variant | batch | " + " | ".join(metrics) + " |", "|---|---|" + "---|" * len(metrics)]
    for variant, batch in dict.fromkeys((r["variant"], r["batch_size"]) for r in rows):
        cellv = []
        for m in metrics:
            r = next((r for r in rows if (r["variant"], r["batch_size"], r["metric"]) == (variant, batch, m)), None)
            if r is None:
                cellv.append("–")
                continue
            text = f"{r['mean']:.3f} ± {r['sd']:.3f}"
            if "delta" in r:
                text += f" ({r['delta']:+.3f}{'*' if r['significant'] else ''})"
            cellv.append(text)
        lines.append(f"| {variant} | {batch} | " + " | ".join(cellv) + " |")
    return rows, "\n".join(lines) + "\n"


def plot(cells: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    by_variant: dict[str, list[list]] = {}
    for c in cells.values():
        by_variant.setdefault(f"{c['variant']} (b{c['batch_size']})", []).append(c["curve"])
    for label, curves in by_variant.items():
        steps = sorted({s for curve in curves for s, _ in curve})
        means = [statistics.fmean([v for curve in curves for s2, v in curve if s2 == s]) for s in steps]
        ax.plot(steps, means, marker=".", label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out zero-shot acc1 (mean over seeds)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def teacher_folder(data: Path, teacher: str) -> Path:
    sub = TEACHER_CELLS[teacher][1]
    return data / "train" if sub is None else data / sub


def ensure_teacher(teacher: str, results: dict, batch: int, args, data: Path, name: str, work: Path, path: Path,
                   prior: float, t0: float) -> None:
    """The teacher's cell trained (a cell of its own, so its held-out scores are tabled first) and the
    training split embedded with it (teachers.json in its folder), once."""
    cell = TEACHER_CELLS[teacher][0]
    key = f"{cell}|seed0|b{batch}"
    if key not in results["cells"]:
        print(f"== {key}", flush=True)
        results["cells"][key] = train_cell(cell, 0, batch, args, data, name, work)
        results["wall_seconds"] = round(prior + time.time() - t0, 1)
        write_json(path, results)
    run = cell_dir(work, name, cell, 0, batch, args.steps)
    folder = teacher_folder(data, teacher)
    index = folder / "teachers.json"
    if not index.is_file() or str(run) not in [t["model"] for t in json.loads(index.read_text())["teachers"].values()]:
        out = [] if folder == data / "train" else ["--out", str(folder)]
        run_cli("data_tools", "embed", str(data / "train"), "--image-model", str(run), "--augmentations",
                str(TEACHER_CROPS), "--overwrite", *out, log=work / name / f"{teacher}_embed.log")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variants", nargs="+", metavar="VARIANT")
    p.add_argument("--data", required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[64])
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--eval-every", type=int, default=110)
    p.add_argument("--input-size", type=int, default=INPUT_SIZE,
                   help=f"the model's input in px (default {INPUT_SIZE}), patches of a quarter of it: the same 16 tokens")
    p.add_argument("--tasks", nargs="+", choices=HELDOUT_TASKS, default=list(HELDOUT_TASKS),
                   help="final held-out evaluations (default: all four)")
    p.add_argument("--dense", default=None, help="a dense set (data_tools' dense/: train/ and test/ with label maps) "
                   "for the dense probe; default: the data's dense/ when it has one")
    p.add_argument("--out", default=str(ROOT / "bench_results/experiments"))
    p.add_argument("--work", default=str(ROOT / "runs/experiments"))
    args = p.parse_args()
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        print(f"error: unknown variant {unknown[0]!r}; choose from {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    if args.steps < 1 or args.eval_every < 1 or min(args.batch_sizes) < 1 or args.input_size < 4 or args.input_size % 4:
        print("error: --steps, --eval-every and --batch-sizes must be positive, --input-size a multiple of 4",
              file=sys.stderr)
        return 2
    work, out = Path(args.work), Path(args.out)
    data, name = prepare_data(args.data, work)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    settings = {"data": args.data, "steps": args.steps, "eval_every": args.eval_every, "model": "mmpt-tiny-vit",
                "model_overrides": MODEL_OVERRIDES,
                "region_warmup": REGION_WARMUP, "tasks": sorted(args.tasks)}
    if args.input_size != INPUT_SIZE:
        settings["input"] = {"image_size": args.input_size, "patch_size": args.input_size // 4}
    results = json.loads(path.read_text()) if path.is_file() else {"settings": settings, "cells": {}}
    if results.get("settings") != settings:
        print(f"error: {path} holds a grid with other settings ({results.get('settings')}); pass another --out "
              "or the same --steps/--eval-every", file=sys.stderr)
        return 2
    t0 = time.time()
    # the grid's wall time over every call that added to it (an interrupted call's cells count too)
    prior = results.get("wall_seconds", results.pop("wall_seconds_this_call", 0.0))
    for batch in args.batch_sizes:
        for seed in args.seeds:
            for variant in args.variants:
                key = f"{variant}|seed{seed}|b{batch}"
                if key in results["cells"]:
                    continue
                print(f"== {key}", flush=True)
                teacher = VARIANTS[variant](args.steps).get("teacher")
                if teacher is not None:
                    ensure_teacher(teacher, results, batch, args, data, name, work, path, prior, t0)
                results["cells"][key] = train_cell(variant, seed, batch, args, data, name, work)
                results["wall_seconds"] = round(prior + time.time() - t0, 1)
                write_json(path, results)
                print(f"   {results['cells'][key]['train_seconds']} s: "
                      + ", ".join(f"{m} {results['cells'][key]['metrics'].get(m, float('nan')):.3f}" for m in TABLE[:3]),
                      flush=True)
    rows, table = summarize(results["cells"])
    results["summary"] = rows
    results["wall_seconds_this_call"] = round(time.time() - t0, 1)
    results["wall_seconds"] = round(prior + time.time() - t0, 1)
    write_json(path, results)
    (out / f"{name}.md").write_text(table)
    plot(results["cells"], out / f"{name}_acc1.png")
    print(table)
    print(f"-> {path}, {out / f'{name}.md'}, {out / f'{name}_acc1.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
