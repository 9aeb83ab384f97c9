"""`data_tools embed` sentences/s against raw SentenceTransformer.encode on the same model, captions
and batch, end to end (model load included on both sides), alternating A B A B in one run.

    python scripts/bench_embed.py [--model sentence-transformers/all-MiniLM-L6-v2] [--repeats 3]

Data: the packaged OpenMoji captions (1,463), built into shards in a temporary folder. Ours also reads
every shard and rewrites it with the embeddings. Writes bench_results/embed.json (ratio = ours / raw).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import report_ratio  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    from data_tools.build import build
    from data_tools.embed import dataset_folders, embed
    from mmpretrain.data.manifest import read_sizes
    from mmpretrain.data.tar import read_tar

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "openmoji"
        build("demo:openmoji", data, image_size=32, shard_size=200)
        captions = [s["txt"].decode() for f in dataset_folders(data) for n in sorted(read_sizes(f))
                    for s in read_tar(f / n)]

        def raw() -> float:
            t0 = time.perf_counter()
            SentenceTransformer(args.model).encode(captions, batch_size=args.batch_size, normalize_embeddings=True,
                                                   convert_to_numpy=True)
            return len(captions) / (time.perf_counter() - t0)

        def ours() -> float:
            t0 = time.perf_counter()
            res = embed(data, args.model, overwrite=True, batch_size=args.batch_size)
            assert sum(r["embedded"] for r in res) == len(captions)
            return len(captions) / (time.perf_counter() - t0)

        raw_runs, our_runs = [], []
        for _ in range(args.repeats):
            raw_runs.append(raw())
            our_runs.append(ours())
    report_ratio("embed", raw_runs, our_runs, ("raw encode sent/s", "data_tools embed sent/s"), 0.95,
                 {"captions": len(captions), "model": args.model, "batch_size": args.batch_size,
                  "raw_sentences_per_s": raw_runs, "ours_sentences_per_s": our_runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
