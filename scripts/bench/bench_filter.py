"""``data_tools filter`` on a CC3M-sized index: time and memory of the score and SemDeDup rules, the
planted duplicates found, and scikit-learn's k-means against faiss's on the same rows.

    python scripts/bench/bench_filter.py [--n 2900000] [--dim 512] [--shard-size 1000] [--work /tmp/bench_filter]

The index is synthetic (what is timed is the filter, not the data): ``--n`` teacher rows in the layout
``data_tools embed --image-model --augmentations 0`` writes (float16, ``--dim``), around 5,000 random
topics, with 2 % of the rows planted as near-copies (cosine ~0.995) of another row of their shard; the text rows are the
image rows plus noise. The shards are empty placeholder files: these rules read only the rows. Runs, in
one process each (peak RSS from /proc): ``filter --score teacher --keep-top 0.3`` and ``filter --dedup
image`` at the default k (sqrt(n)). The k-means comparison fits both libraries on the filter's fitting
sample (100,000 rows) at the same k and iterations: the filter uses faiss (a dependency since this
measurement) and falls back to scikit-learn. Writes bench_results/filter.json (ratio = scikit-learn's
fit time / faiss's: the speed-up of the k-means the filter uses).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchlib import table, write_result  # a sibling: the script's folder is on sys.path

ROOT = Path(__file__).resolve().parents[2]

TID = "synthetic-00000000"


def make_index(work: Path, n: int, dim: int, shard: int, seed: int = 0) -> np.ndarray:
    """The index in ``work``; returns the planted copies' positions (sorted)."""
    from mmpretrain.data.teacher import TEACHERS, teacher_files

    rng = np.random.default_rng(seed)
    work.mkdir(parents=True, exist_ok=True)
    topics = rng.standard_normal((5000, dim)).astype(np.float32)
    copies = np.sort(rng.choice(n, n // 50, replace=False))
    sizes, shards = {}, {}
    planted = np.zeros(n, dtype=bool)
    planted[copies] = True
    for s, a in enumerate(range(0, n, shard)):
        b = min(n, a + shard)
        name = f"synthetic-{s:06d}.tar"
        r = np.random.default_rng([seed, s])
        x = topics[r.integers(0, len(topics), b - a)] + 1.2 * r.standard_normal((b - a, dim), dtype=np.float32)
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        mine, others = np.flatnonzero(planted[a:b]), np.flatnonzero(~planted[a:b])
        x[mine] = x[r.choice(others, len(mine))] + 0.1 * r.standard_normal((len(mine), dim), dtype=np.float32) / math.sqrt(dim)
        x /= np.linalg.norm(x, axis=1, keepdims=True)  # a planted row: cosine ~0.995 to its original
        text = x + 0.8 * r.standard_normal(x.shape, dtype=np.float32) / math.sqrt(dim)
        keys = [f"{a + i:09d}" for i in range(b - a)]
        (work / name).touch()
        (work / (name + ".teacher_keys.txt")).write_text("".join(k + "\n" for k in keys))
        np.save(work / (name + ".crops.npy"), np.zeros((b - a, 1, 4), np.int32))
        np.save(work / (name + ".caption_counts.npy"), np.zeros(b - a, np.int64))
        image_f, text_f, extra_f = teacher_files(TID)
        np.save(work / (name + image_f), x[:, None, :].astype(np.float16))
        np.save(work / (name + text_f), text.astype(np.float16))
        np.save(work / (name + extra_f), np.zeros((0, dim), np.float16))
        sizes[name] = b - a
        shards[name] = {"count": b - a, "bytes": None, "first_key": keys[0], "extra": 0}
    (work / "sizes.json").write_text(json.dumps(sizes))
    aug = {"count": 0, "seed": 0, "scale": [0.9, 1.0], "ratio": [0.75, 1.3333], "sampler": "random_resized_crop"}
    (work / TEACHERS).write_text(json.dumps({"version": 1, "augmentations": aug, "teachers": {TID: {
        "model": "synthetic", "pretrained": None, "dim": dim, "logit_scale": 100.0, "shards": shards}}}))
    return copies


def run_filter(work: Path, out: Path, *rules: str) -> tuple[float, float, dict]:
    """(seconds, peak RSS GiB, keep.json) of one filter process."""
    code = ("import resource, sys, runpy; sys.argv = ['data_tools'] + sys.argv[1:]; "
            "rc = 0\ntry:\n    runpy.run_module('data_tools', run_name='__main__')\nexcept SystemExit as e:\n"
            "    rc = e.code or 0\nprint('PEAK_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "
            "file=sys.stderr)\nsys.exit(rc)")
    t = time.time()
    r = subprocess.run([sys.executable, "-c", code, "filter", str(work), "--out", str(out), "--overwrite", *rules],
                       capture_output=True, text=True, cwd=ROOT)
    seconds = time.time() - t
    if r.returncode:
        raise SystemExit(f"filter {' '.join(rules)} failed:\n{r.stderr[-3000:]}")
    peak = int(r.stderr.rsplit("PEAK_KB", 1)[1].split()[0]) / 2 ** 20
    return seconds, peak, json.loads((out / "keep.json").read_text())


def kmeans_fits(work: Path, k: int, rows: int = 100_000) -> dict:
    from data_tools.curate import unit
    from mmpretrain.data.teacher import teacher_files

    names = sorted(json.loads((work / "sizes.json").read_text()))
    x = np.concatenate([np.load(work / (n + teacher_files(TID)[0]))[:, 0] for n in names[: math.ceil(rows / 1000)]])
    x = unit(x[:rows])
    from sklearn.cluster import KMeans

    t = time.time()
    KMeans(n_clusters=k, random_state=0, n_init=1, max_iter=20).fit(x)
    out = {"rows": len(x), "k": k, "iterations": 20, "sklearn_s": round(time.time() - t, 1)}
    try:
        import faiss
    except ImportError:
        out["faiss_s"] = None
        return out
    t = time.time()
    km = faiss.Kmeans(x.shape[1], k, niter=20, seed=0, spherical=True, max_points_per_centroid=10 ** 9)
    km.train(x)
    out["faiss_s"] = round(time.time() - t, 1)
    out["faiss_version"] = faiss.__version__
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=2_900_000)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--shard-size", type=int, default=1000)
    p.add_argument("--work", default="/tmp/bench_filter")
    args = p.parse_args()
    work = Path(args.work) / f"n{args.n}_d{args.dim}"
    t = time.time()
    if not (work / "sizes.json").is_file():
        copies = make_index(work, args.n, args.dim, args.shard_size)
        np.save(work.parent / f"{work.name}.copies.npy", copies)
    copies = np.load(work.parent / f"{work.name}.copies.npy")
    made = time.time() - t
    rows, results = [], {"n": args.n, "dim": args.dim, "index_seconds": round(made, 1), "planted": len(copies)}
    s, peak, index = run_filter(work, work.parent / "keep_score", "--score", "teacher", "--keep-top", "0.3")
    results["score"] = {"seconds": round(s, 1), "peak_rss_gib": round(peak, 2), "kept": index["kept"]}
    rows.append(("--score teacher --keep-top 0.3", f"{s:.1f}", f"{peak:.2f}", index["kept"], "–"))
    s, peak, index = run_filter(work, work.parent / "keep_dedup", "--dedup", "image", "--threshold", "0.95")
    kept = np.concatenate([np.load(work.parent / "keep_dedup" / f"{n}.keep.npy") + i * args.shard_size
                           for i, n in enumerate(sorted(index["shards"]))])
    removed = np.setdiff1d(np.arange(args.n), kept)
    # each planted row copies an unplanted row of its shard (random rows are ~0.4 apart): one of each pair
    # should go; more removed than planted would be false positives (rows of one original count once each)
    found = len(removed)
    results["dedup"] = {"seconds": round(s, 1), "peak_rss_gib": round(peak, 2), "removed": found,
                        "clusters": index["rules"][0]["clusters"], "kmeans": index["rules"][0]["kmeans"],
                        "planted_pairs": len(copies),
                        "removed_per_planted_pair": round(found / len(copies), 3)}
    rows.append((f"--dedup image (k = {index['rules'][0]['clusters']})", f"{s:.1f}", f"{peak:.2f}", index["kept"],
                 f"{found} removed / {len(copies)} planted"))
    fits = kmeans_fits(work, index["rules"][0]["clusters"])
    results["kmeans_fit"] = fits
    print(table(rows, ("rule", "seconds", "peak RSS GiB", "kept", "duplicates")))
    print(f"k-means fit on {fits['rows']} rows, k = {fits['k']}, 20 iterations: scikit-learn {fits['sklearn_s']} s, "
          f"faiss {fits['faiss_s']} s")
    ratio = (fits["sklearn_s"] / fits["faiss_s"]) if fits.get("faiss_s") else float("nan")
    path = write_result("filter", ratio, True, 1.0, [ratio], results)
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
