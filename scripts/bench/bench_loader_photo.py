"""Training-loader images/s on photo-like data at the resolution users train at: ours against
open_clip_train's ``get_wds_dataset`` and the decode limit, A B C D A B C D in one run, plus a per-stage
profile of our per-sample work.

    python scripts/bench/bench_loader_photo.py [--images 1200] [--image-size 224] [--batch-size 128]
                                         [--workers 2] [--epochs 2] [--repeats 2]

Data: the colour photos scikit-image and scikit-learn ship (astronaut, chelsea, coffee, rocket,
motorcycle, retina, hubble, ihc, china, flower), each JPEG a different random crop (area 30-100 %,
aspect 1:1, 4:3, 3:2, 2:1 or portrait), flip and scale (shorter side 256-512 px), quality 90, as
img2dataset writes web images; WebDataset shards of 100 with sizes.json, in a temporary folder.
- ours: mmpretrain.data.stream as the trainer runs it: open_clip's training transform taken by the fast
  crop path (mmpretrain.data.crop: box drawn from the header, reduced decode, (H, W, 3) uint8 hand-over,
  normalised on the device), open_clip's tokenizer, epoch mode.
- open_clip: get_wds_dataset with the same transform (float, normalised in the worker) and tokenizer.
- decode limit: Pillow open + convert + open_clip's crop and resize to a uint8 tensor (no normalise),
  from bytes in memory, in --workers processes at once (sharing the cores as the loaders do).
- ours, data.decode=device with the device set to this CPU: the workers read and draw the crop box, the
  benchmark's process decodes each batch (torchvision decode_jpeg at full size), crops and resizes, as
  the trainer does (mmpretrain.data.device_decode). A GPU's figure comes from scripts/bench/bench_gpu.sh.
Timing covers --epochs passes, worker start included. Writes bench_results/loader_photo.json
(ratio = ours / open_clip), bench_results/loader_photo_limit.json (ours / the decode limit) and
bench_results/loader_photo_device_cpu.json (decode=device on the CPU / decode=worker).
"""

from __future__ import annotations

import argparse
import io
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image

from mmpretrain.testing.photos import make_jpegs, write_shards  # noqa: E402

from benchlib import open_clip_rate, report_ratio, stream_rate, table  # noqa: E402

_LIMIT: dict = {}


def _limit_init(size: int) -> None:
    import torch

    torch.set_num_threads(1)  # as a DataLoader worker: a forked OpenMP pool would hang
    from open_clip.transform import PreprocessCfg, image_transform_v2

    from mmpretrain.data.decode import split_normalize
    _LIMIT["t"] = split_normalize(image_transform_v2(PreprocessCfg(size=size), is_train=True))[0]


def _limit_work(chunk: list[bytes]) -> int:
    t = _LIMIT["t"]
    for b in chunk:
        t(Image.open(io.BytesIO(b)).convert("RGB"))
    return len(chunk)


def profile(samples: list[tuple[str, bytes]], folder: Path, size: int, batch: int) -> dict:
    """Milliseconds per sample of each stage of our worker's work, one process, on the first 512 samples:
    ours (the fast crop: box drawn from the header, reduced decode, one resize to (H, W, 3)) and, for
    comparison, torchvision's per-sample path (full decode + convert, then open_clip's RandomResizedCrop
    and PILToTensor)."""
    import open_clip
    import torch
    from open_clip.transform import PreprocessCfg, image_transform_v2

    from mmpretrain.data.batch import collate
    from mmpretrain.data.decode import augmentation_seed, split_normalize
    from mmpretrain.data.tar import read_tar

    full = image_transform_v2(PreprocessCfg(size=size), is_train=True)
    fast, tv = split_normalize(full, fast=True)[0], split_normalize(full)[0]
    tok = open_clip.get_tokenizer("ViT-B-32")
    raw = []
    t0 = time.perf_counter()
    for shard in sorted(folder.glob("*.tar")):
        raw.extend(read_tar(shard))
        if len(raw) >= 512:
            break
    raw = raw[:512]
    n = len(raw)
    read = time.perf_counter() - t0
    # ours, stage by stage, one sample at a time (nothing decoded is kept but the output)
    sample = decode = crop = tv_decode = tv_crop = 0.0
    reduced, tensors = 0, []
    for s in raw:
        t0 = time.perf_counter()
        im = Image.open(io.BytesIO(s["jpg"]))
        box = fast.box(im, augmentation_seed(0, 0, s["__key__"]))
        t1 = time.perf_counter()
        im, r = fast.decode(im, box)
        t2 = time.perf_counter()
        tensors.append(fast.resize(im, box, r))
        t3 = time.perf_counter()
        sample, decode, crop, reduced = sample + t1 - t0, decode + t2 - t1, crop + t3 - t2, reduced + (r > 1)
        del im
        # torchvision's per-sample path on the same bytes
        t0 = time.perf_counter()
        im = Image.open(io.BytesIO(s["jpg"])).convert("RGB")
        t1 = time.perf_counter()
        tv(im)
        tv_decode, tv_crop = tv_decode + t1 - t0, tv_crop + time.perf_counter() - t1
        del im
    # the device path's work with the device set to this CPU: the full-size decode, then the box resized
    from mmpretrain.data.device_decode import DeviceDecoder

    dev = DeviceDecoder(fast, "cpu")
    blobs = [torch.frombuffer(bytearray(s["jpg"]), dtype=torch.uint8) for s in raw]
    t0 = time.perf_counter()
    decoded = [d for i in range(0, n, batch) for d in dev._decode(blobs[i:i + batch])]
    t1 = time.perf_counter()
    boxes = [list(fast.box(Image.open(io.BytesIO(s["jpg"])), augmentation_seed(0, 0, s["__key__"]))) for s in raw]
    for i in range(0, n, batch):  # the batched crop stage (mmpretrain/data/resample.py), as the trainer runs it
        part = decoded[i:i + batch]
        dev.crop_stage(torch.empty((len(part), 3, *fast.size)), part, torch.tensor(boxes[i:i + batch]),
                       torch.arange(len(part)))
    dev_decode, dev_crop = t1 - t0, time.perf_counter() - t1
    del decoded
    reduced /= n
    caps = [s["txt"].decode() for s in raw]
    t0 = time.perf_counter()
    for i in range(0, n, batch):
        tok(caps[i:i + batch])
    tokenize = time.perf_counter() - t0
    items = [{"image": x, "text": c, "key": str(i), "index": i} for i, (x, c) in enumerate(zip(tensors, caps))]
    t0 = time.perf_counter()
    for i in range(0, n, batch):
        collate(items[i:i + batch])
    coll = time.perf_counter() - t0
    # hand-over: a batch through a worker queue (shared memory), per sample
    from torch.utils.data import DataLoader, IterableDataset

    class One(IterableDataset):
        def __iter__(self):
            for _ in range(8):
                yield collate(items[:batch])
    t0 = time.perf_counter()
    for _ in DataLoader(One(), batch_size=None, num_workers=1):
        pass
    hand = (time.perf_counter() - t0) / (8 * batch)
    out = {k: round(v * 1e3, 3) for k, v in {
        "read": read / n, "crop box from the header": sample / n, "decode (reduced where the box allows)": decode / n,
        "crop + resize": crop / n, "tokenize": tokenize / n, "collate": coll / n,
        "hand-over (incl. worker start)": hand, "torchvision path: decode + convert": tv_decode / n,
        "torchvision path: RandomResizedCrop + PILToTensor": tv_crop / n,
        "device path on the CPU: decode_jpeg (full size)": dev_decode / n,
        "device path on the CPU: header box + crop stage (image by image on a CPU)": dev_crop / n}.items()}
    out["share of JPEGs decoded reduced"] = round(reduced, 3)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=1200)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import open_clip
    from open_clip.transform import PreprocessCfg, image_transform_v2

    from mmpretrain.data.sources import resolve_sources

    full = image_transform_v2(PreprocessCfg(size=args.image_size), is_train=True)
    tokenizer = open_clip.get_tokenizer("ViT-B-32")
    samples = make_jpegs(args.images)
    jpgs = [b for _, b in samples]
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "photos"
        write_shards(samples, data)
        sources = resolve_sources(str(data))
        n = sum(s.num_samples for s in sources)
        pattern = str(data / f"photo-{{000000..{len(list(data.glob('*.tar'))) - 1:06d}}}.tar")

        def theirs() -> float:
            return open_clip_rate(pattern, full, tokenizer, args.batch_size, args.workers, args.epochs)

        def ours() -> float:
            return stream_rate(sources, full, tokenizer, args.batch_size, args.workers, args.epochs)

        def device() -> float:  # data.decode=device with the device set to this CPU
            return stream_rate(sources, full, tokenizer, args.batch_size, args.workers, args.epochs, "device", "cpu")

        def limit() -> float:
            W = max(1, args.workers)
            chunks = [jpgs[i::W] for i in range(W)] * args.epochs
            t0 = time.perf_counter()
            with mp.get_context("fork").Pool(W, _limit_init, (args.image_size,)) as pool:
                seen = sum(pool.map(_limit_work, chunks, chunksize=1))
            return seen / (time.perf_counter() - t0)

        ref_runs, our_runs, lim_runs, dev_runs = [], [], [], []
        for _ in range(args.repeats):
            ref_runs.append(theirs())
            our_runs.append(ours())
            lim_runs.append(limit())
            dev_runs.append(device())
        stages = profile(samples, data, args.image_size, args.batch_size)
    of_limit = [o / m for o, m in zip(our_runs, lim_runs)]
    print(table([(i, f"{r:.0f}", f"{o:.0f}", f"{d:.0f}", f"{m:.0f}", f"{o / m:.2f}", f"{r / m:.2f}")
                 for i, (r, o, d, m) in enumerate(zip(ref_runs, our_runs, dev_runs, lim_runs))],
                ("run", "open_clip img/s", "ours img/s", "ours decode=device (CPU) img/s", "decode limit img/s",
                 "ours / limit", "open_clip / limit")))
    print(table(list(stages.items()), ("stage (ours, one process)", "ms per sample")))
    report_ratio("loader_photo", ref_runs, our_runs, ("open_clip get_wds_dataset img/s", "mmpretrain stream img/s"),
                 1.5, {"samples": n, "image_size": args.image_size, "batch_size": args.batch_size,
                       "workers": args.workers, "epochs": args.epochs, "open_clip_images_per_s": ref_runs,
                       "ours_images_per_s": our_runs, "decode_limit_images_per_s": lim_runs,
                       "ours_over_limit": of_limit, "stage_ms_per_sample": stages})
    report_ratio("loader_photo_limit", lim_runs, our_runs, ("decode limit img/s", "mmpretrain stream img/s"), 0.85,
                 {"samples": n, "image_size": args.image_size, "workers": args.workers,
                  "decode_limit_images_per_s": lim_runs, "ours_images_per_s": our_runs,
                  "note": "the same run as loader_photo.json"})
    report_ratio("loader_photo_device_cpu", our_runs, dev_runs, ("data.decode=worker img/s", "data.decode=device img/s"),
                 None, {"samples": n, "image_size": args.image_size, "workers": args.workers, "device": "cpu",
                       "worker_images_per_s": our_runs, "device_images_per_s": dev_runs,
                       "note": "the same run as loader_photo.json; the device path is for GPUs (nvJPEG): on a CPU "
                               "the training process decodes at full size what the workers decoded reduced"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
