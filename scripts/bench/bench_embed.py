"""`data_tools embed` sentences/s against raw SentenceTransformer.encode on the same model, captions
and batch, end to end (model load included on both sides), alternating A B A B in one run.

    python scripts/bench/bench_embed.py [--model sentence-transformers/all-MiniLM-L6-v2] [--captions 20000] [--repeats 3]

Data: the packaged OpenMoji captions (their Unicode names), repeated to ``--captions`` and written as
shards of 1,000 samples (a 1x1 PNG and the caption each) in a temporary folder. Ours reads every
shard's captions and writes the sidecar embeddings beside it (no shard is rewritten). Writes
bench_results/embed.json (ratio = ours / raw).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from mmpretrain.config.base import DEMO_TEXT_MODEL

from benchlib import report_ratio


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEMO_TEXT_MODEL)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--captions", type=int, default=20_000)
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import io
    import json

    import webdataset as wds
    from PIL import Image
    from sentence_transformers import SentenceTransformer

    from data_tools.embed import embed
    from data_tools.sources.openmoji import list_emoji

    names = [e.name for e in list_emoji()]
    captions = [f"{names[i % len(names)]}" for i in range(args.captions)]
    png = io.BytesIO()
    Image.new("RGB", (1, 1)).save(png, format="PNG")
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "captions"
        data.mkdir()
        sizes = {}
        for k in range(0, len(captions), 1000):
            name = f"bench-{k // 1000:06d}.tar"
            with wds.TarWriter(str(data / name), encoder=False) as w:
                for i, c in enumerate(captions[k:k + 1000]):
                    w.write({"__key__": f"{k + i:09d}", "png": png.getvalue(), "txt": c.encode()})
            sizes[name] = len(captions[k:k + 1000])
        (data / "sizes.json").write_text(json.dumps(sizes))

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
