"""Training-loader images/s: ``mmpretrain.data.stream`` against open_clip_train's
``get_wds_dataset`` on the same shards, transform, tokenizer, batch and workers, alternating A B A B
in one run.

    python scripts/bench/bench_loader.py [--image-size 32] [--shard-px 256] [--batch-size 128] [--workers 2]
                                   [--epochs 3] [--repeats 3]

Data: the packaged OpenMoji emoji built by ``data_tools build demo:openmoji`` as 256 px JPEG shards
(web data as img2dataset writes it) in a temporary folder. Both sides decode, apply open_clip's
training transform (random resized crop to --image-size), tokenize the caption with open_clip's
tokenizer and batch inside the workers; neither reads stored embeddings. Timing covers --epochs
passes over the training split, worker start included. Writes bench_results/loader.json
(ratio = ours / open_clip, images/s).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from benchlib import open_clip_rate, report_ratio, stream_rate  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--image-size", type=int, default=32, help="model input (the packaged tiny CPU configs: 32)")
    p.add_argument("--shard-px", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import open_clip
    from open_clip.transform import PreprocessCfg, image_transform_v2

    from data_tools.build import build
    from mmpretrain.data.sources import resolve_sources

    transform = image_transform_v2(PreprocessCfg(size=args.image_size), is_train=True)
    tokenizer = open_clip.get_tokenizer("ViT-B-32")
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "openmoji"
        build("demo:openmoji", data, image_size=args.shard_px, shard_size=100, image_format="jpg")
        train = data / "train"
        shards = sorted(x.name for x in train.glob("*.tar"))
        pattern = str(train / f"openmoji-train-{{000000..{len(shards) - 1:06d}}}.tar")
        sources = resolve_sources(str(train))
        n = sum(s.num_samples for s in sources)

        def theirs() -> float:
            return open_clip_rate(pattern, transform, tokenizer, args.batch_size, args.workers, args.epochs)

        def ours() -> float:
            return stream_rate(sources, transform, tokenizer, args.batch_size, args.workers, args.epochs)

        ref_runs, our_runs = [], []
        for _ in range(args.repeats):
            ref_runs.append(theirs())
            our_runs.append(ours())
    report_ratio("loader", ref_runs, our_runs, ("open_clip get_wds_dataset img/s", "mmpretrain stream img/s"), 1.2,
                 {"samples": n, "shard_px": args.shard_px, "image_size": args.image_size,
                  "batch_size": args.batch_size, "workers": args.workers, "epochs": args.epochs,
                  "open_clip_images_per_s": ref_runs, "ours_images_per_s": our_runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
