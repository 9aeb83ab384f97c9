"""`data_tools embed --image-model` images/s against the teacher's bare forward on the same views, in one
run, alternating A B A B.

    python scripts/bench/bench_teacher_embed.py [--teacher RUN] [--data DIR] [--augmentations 10]
                                                [--batch-size 256] [--repeats 3]

Bare: every image's evaluation view and K crops made beforehand (the same crops embed draws), then only
``encode_image`` over batches of ``--batch-size`` views and ``encode_text`` over the captions in batches
of the same size, in this process (the same torch threads). Ours: the whole command -- teacher load,
reading the shards, decoding, cropping (a thread pool beside the forward), both encoders, writing the
files -- into a fresh folder. Defaults: the evidence grid's teacher and its training split
(`python scripts/reports/experiment.py distill --data demo:openmoji-all` makes both). Writes
bench_results/teacher_embed.json (ratio = ours / bare; target >= 0.9).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from benchlib import report_ratio  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", default=str(ROOT / "runs/experiments/openmoji-all/teacher_s0_b64"))
    p.add_argument("--data", default=str(ROOT / "runs/experiments/data/openmoji-all/train"))
    p.add_argument("--augmentations", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=2, help="embed's decode and crop threads")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for path in (args.teacher, args.data):
        if not Path(path).is_dir():
            print(f"error: {path} is not there; make it with `python scripts/reports/experiment.py distill --data "
                  "demo:openmoji-all --seeds 0` or pass --teacher/--data", file=sys.stderr)
            return 2
    import torch

    from data_tools.embed_teacher import SAMPLER, Teacher, _sample, embed_teachers
    from mmpretrain.data.crop import CropSampler
    from mmpretrain.data.manifest import read_sizes
    from mmpretrain.data.tar import read_tar

    teacher = Teacher(args.teacher, None, "cpu")
    k = args.augmentations
    aug = {"count": k, "seed": 0, "scale": [0.9, 1.0], "ratio": [3 / 4, 4 / 3], "sampler": SAMPLER}
    sampler = CropSampler(aug["scale"], aug["ratio"])
    names = sorted(read_sizes(Path(args.data)))
    views, captions = [], []
    for name in names:
        for raw in read_tar(str(Path(args.data) / name)):
            img, crops, caption, extra = _sample(raw, sampler, k, 0)
            views.append(teacher.views(img, [tuple(b) for b in crops[1:]]))
            captions += [caption, *extra]
    views = torch.cat(views)
    n_images = views.shape[0] // (1 + k)

    def bare() -> float:
        t0 = time.perf_counter()
        for i in range(0, views.shape[0], args.batch_size):
            teacher.image(views[i:i + args.batch_size])
        teacher.text(captions, args.batch_size)
        return n_images / (time.perf_counter() - t0)

    def ours() -> float:
        with tempfile.TemporaryDirectory() as out:
            t0 = time.perf_counter()
            res = embed_teachers(args.data, [args.teacher], augmentations=k, out=out, overwrite=True, workers=args.workers,
                                 batch_size=args.batch_size, device="cpu")
            dt = time.perf_counter() - t0
        assert sum(r["images"] for r in res) == n_images
        return n_images / dt

    bare_runs, our_runs = [], []
    for _ in range(args.repeats):
        bare_runs.append(bare())
        our_runs.append(ours())
    report_ratio("teacher_embed", bare_runs, our_runs, ("bare forward img/s", "embed --image-model img/s"), 0.9,
                 {"images": n_images, "views_per_image": 1 + k, "captions": len(captions), "teacher": args.teacher,
                  "teacher_dim": teacher.dim, "teacher_input": list(teacher.size), "data": args.data,
                  "batch_size": args.batch_size, "torch_threads": torch.get_num_threads(),
                  "bare_images_per_s": bare_runs, "ours_images_per_s": our_runs,
                  "shards": len(names), "crop_scale": aug["scale"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
