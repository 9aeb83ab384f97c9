"""What curation buys on noisy captions, measured: one command.

    python scripts/reports/curation.py [--noise 0.3] [--seeds 0 1 2] [--out bench_results/experiments]
                                       [--work runs/experiments]

On the evidence bed (demo:openmoji-all, as scripts/reports/experiment.py builds it), a copy of the
training split has a share ``--noise`` of its samples' captions (caption 0 and the extra captions
together) moved to another corrupted sample (a seeded derangement: every corrupted sample gets a caption
that is not its own). Then ``clip`` -- the grid's cell: same model, steps, batch and evaluation -- trains on

- ``noisy``: the corrupted split;
- ``filtered``: the corrupted split through ``data_tools filter --score teacher --keep-top 1 - noise``,
  the teacher being the ``noisy`` cell of seed 0 (trained on the corrupted data only: the filter is no
  oracle), its rows from ``data_tools embed --image-model RUN --augmentations 0``;
- ``clean``: the grid's own clip cells (the same settings on the uncorrupted split, read from
  OUT/openmoji-all.json, trained by experiment.py).

Equal steps for all (the filtered run makes more passes over fewer samples); held-out in-style
(test split) and cross-style (Noto, when ``make noto`` fetched it) scores, mean ± sd over seeds. The
filter's precision (share of removed samples that were corrupted) and recall (share of corrupted
samples removed) are measured against the corruption's record. Writes OUT/curation.json and .md.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

import experiment  # a sibling: the script's folder is on sys.path
from experiment import ROOT, TABLE, cell_dir, prepare_data, run_cli, train_cell, write_json

CORRUPTED = "corrupted.json"
OWNED = ".made-by-curation"  # the only folder the script removes holds this


def corrupt(clean: Path, noisy: Path, share: float, seed: int) -> list[str]:
    """``noisy``: ``clean`` with ``share`` of the training captions deranged; test/, noto/ and the class
    files linked from ``clean``. Returns the corrupted keys (also in noisy/corrupted.json)."""
    import webdataset as wds

    from mmpretrain.data.tar import read_tar

    record = noisy / CORRUPTED
    if record.is_file():
        data = json.loads(record.read_text())
        if data["share"] == share and data["seed"] == seed:
            return data["keys"]
        raise SystemExit(f"error: {noisy} was corrupted with other settings ({data['share']}, seed {data['seed']}); "
                         "pass another --work")
    if noisy.exists():  # a copy this script began and did not finish (its marker, no record): made again
        if not (noisy / OWNED).is_file():
            raise SystemExit(f"error: {noisy} exists and this script did not make it (no {OWNED} in it); pass "
                             "another --work")
        shutil.rmtree(noisy)
    (noisy / "train").mkdir(parents=True)
    (noisy / OWNED).write_text("made by scripts/reports/curation.py\n")
    names = sorted(json.loads((clean / "train/sizes.json").read_text()))
    samples = [(n, raw) for n in names for raw in read_tar(clean / "train" / n)]
    rng = random.Random(seed)
    chosen = sorted(rng.sample(range(len(samples)), round(share * len(samples))))
    moved = chosen[1:] + chosen[:1]  # a cyclic shift of a shuffled order: nobody keeps their own caption
    rng.shuffle(moved)
    while any(a == b for a, b in zip(chosen, moved)):
        rng.shuffle(moved)
    caption = {}
    for a, b in zip(chosen, moved):
        src = samples[b][1]
        meta = json.loads(samples[a][1]["json"])
        meta["captions"] = json.loads(src["json"]).get("captions", [])
        caption[a] = (src["txt"], json.dumps(meta).encode())
    for name in names:
        with wds.TarWriter(str(noisy / "train" / name)) as w:
            for i, (n, raw) in enumerate(samples):
                if n != name:
                    continue
                sample = {k: v for k, v in raw.items() if not k.startswith("__") or k == "__key__"}
                if i in caption:
                    sample["txt"], sample["json"] = caption[i]
                w.write(sample)
    shutil.copy(clean / "train/sizes.json", noisy / "train/sizes.json")
    manifest = json.loads((clean / "train/manifest.json").read_text())
    manifest["corrupted"] = {"share": share, "seed": seed, "samples": len(chosen)}
    (noisy / "train/manifest.json").write_text(json.dumps(manifest, indent=1))
    for item in ("test", "noto", "classnames.txt", "zeroshot_classification_templates.txt"):
        if (clean / item).exists():
            (noisy / item).symlink_to((clean / item).resolve())
    run_cli("data_tools", "embed", str(noisy / "train"), "--model", experiment.MINILM, log=noisy / "embed.log")
    keys = [samples[i][1]["__key__"] for i in chosen]
    write_json(record, {"share": share, "seed": seed, "keys": keys})
    return keys


def summary(cells: list[dict]) -> dict:
    out = {}
    for m in TABLE:
        vals = [c["metrics"][m] for c in cells if m in c["metrics"]]
        if vals:
            out[m] = {"mean": statistics.fmean(vals), "sd": statistics.stdev(vals) if len(vals) > 1 else 0.0,
                      "n": len(vals), "values": vals}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--noise", type=float, default=0.3)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", default=str(ROOT / "bench_results/experiments"))
    p.add_argument("--work", default=str(ROOT / "runs/experiments"))
    args = p.parse_args()
    if not 0 < args.noise < 1:
        print("error: --noise is a share in (0, 1)", file=sys.stderr)
        return 2
    work, out = Path(args.work), Path(args.out)
    clean, _ = prepare_data("demo:openmoji-all", work)
    grid = out / "openmoji-all.json"
    clean_cells = json.loads(grid.read_text())["cells"] if grid.is_file() else {}
    missing = [s for s in args.seeds if f"clip|seed{s}|b64" not in clean_cells]
    if missing:
        print(f"error: the clean clip cells of seeds {missing} are not in {grid}: run `python scripts/reports/"
              f"experiment.py clip --data demo:openmoji-all --seeds {' '.join(map(str, missing))}` first", file=sys.stderr)
        return 2
    name = f"openmoji-all-noisy{round(100 * args.noise)}"
    noisy = work / "data" / name
    t0 = time.time()
    corrupted = set(corrupt(clean, noisy, args.noise, seed=0))
    cfg = argparse.Namespace(steps=experiment.STEPS, eval_every=110, tasks=list(experiment.HELDOUT_TASKS),
                             input_size=experiment.INPUT_SIZE)
    path = out / "curation.json"
    results = json.loads(path.read_text()) if path.is_file() else {}
    settings = {"noise": args.noise, "steps": cfg.steps, "keep_top": round(1 - args.noise, 6), "teacher": "noisy|seed0"}
    if results.get("settings") != settings:
        results = {"settings": settings, "cells": {}}
    cells = results["cells"]

    def cell(kind: str, seed: int, data: Path, keep: Path | None = None) -> dict:
        key = f"{kind}|seed{seed}"
        if key not in cells:
            print(f"== {key}", flush=True)
            variant = "clip" if keep is None else "clip_filtered"
            if keep is not None:
                experiment.VARIANTS["clip_filtered"] = lambda steps: {"loss": [{"name": "clip"}],
                                                                      "data": {"keep": str(keep)}}
            cells[key] = train_cell(variant, seed, 64, cfg, data, name, work)
            write_json(path, results)
        return cells[key]

    for seed in args.seeds:
        cell("noisy", seed, noisy)
        if seed == args.seeds[0]:  # the teacher: the noisy cell of the first seed, and the keep-list from it
            teacher = cell_dir(work, name, "clip", args.seeds[0], 64, cfg.steps)
            rows = noisy / "teacher_rows"
            if not (rows / "teachers.json").is_file():
                run_cli("data_tools", "embed", str(noisy / "train"), "--image-model", str(teacher), "--augmentations",
                        "0", "--out", str(rows), log=noisy / "teacher_embed.log")
            keep = noisy / "keep"
            run_cli("data_tools", "filter", str(noisy / "train"), "--embeddings", str(rows), "--score", "teacher",
                    "--keep-top", str(settings["keep_top"]), "--out", str(keep), "--overwrite", log=noisy / "filter.log")
            index = json.loads((keep / "keep.json").read_text())
            kept = {k for n in index["shards"] for k in (keep / f"{n}.keep.txt").read_text().splitlines()}
            everything = set(k for n in index["shards"]
                             for k in (noisy / "train" / f"{n}.keys.txt").read_text().splitlines())
            removed = everything - kept
            results["filter"] = {"removed": len(removed), "corrupted": len(corrupted),
                                 "precision": len(removed & corrupted) / max(1, len(removed)),
                                 "recall": len(removed & corrupted) / len(corrupted),
                                 "kept_corrupted_share": len(kept & corrupted) / len(kept),
                                 "score_threshold": index["rules"][0]["threshold"]}
        cell("filtered", seed, noisy, keep=noisy / "keep")
    results["summary"] = {kind: summary([c for k, c in cells.items() if k.startswith(kind + "|")])
                          for kind in ("noisy", "filtered")}
    results["summary"]["clean"] = summary([clean_cells[f"clip|seed{s}|b64"] for s in args.seeds])
    results["wall_seconds_this_call"] = round(time.time() - t0, 1)
    write_json(path, results)
    lines = ["| data | " + " | ".join(TABLE) + " |", "|---|" + "---|" * len(TABLE)]
    for kind in ("clean", "noisy", "filtered"):
        s = results["summary"][kind]
        lines.append(f"| {kind} | " + " | ".join(f"{s[m]['mean']:.3f} ± {s[m]['sd']:.3f}" if m in s else "–"
                                                 for m in TABLE) + " |")
    f = results["filter"]
    lines.append(f"\nfilter: removed {f['removed']}, precision {f['precision']:.3f}, recall {f['recall']:.3f} "
                 f"({f['corrupted']} corrupted)")
    (out / "curation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
