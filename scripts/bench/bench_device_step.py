"""data.decode=device's step path on this CPU, per-image (the earlier code) against batched (now), in one run:

    python scripts/bench/bench_device_step.py [--photos 256] [--image-size 224] [--repeats 3]

Data: photo-like JPEGs (mmpretrain.testing.photos: the packaged photos, random crops, shorter side
256-512 px, quality 90), decoded by torchvision's CPU decoder; crop boxes drawn as the workers draw them
(open_clip's scale 0.08-1), keeping those the device takes (the worker would decode them at full size).

1. Crop stage, at B = 64 and 256: operator calls per batch (torch.profiler, top-level calls: what Python
   issues; on CUDA each is one launch or a few) and host ms per batch (on a CPU the operators also do
   their work here, so this is compute plus launch), for
   - per-image: torchvision v2 ``resized_crop`` of each image as the CUDA path ran it (float cast,
     antialiased bicubic ``interpolate``, clamp, round, uint8 cast) and its copy into the batch -- forced
     to the float path, since the CPU would take torchvision's native uint8 shortcut the GPU has not;
   - batched: ``DeviceDecoder.crop_stage`` (pad, gather the boxes, two matrix products with Pillow's
     weights, normalise into the batch, the truncated_jpeg tail check), its transient memory and flops
     at B = 256;
   - roi_align: torchvision.ops.roi_align over the same gathered boxes (a box filter);
   and each one's pixel difference against the worker path (Pillow), in grey levels.
2. Bytes per batch through shared memory (the collated batch's tensors) at B = 256, with each
   device-taken slot carrying a zero placeholder image (earlier) and no pixels (now).
3. Worker-side microseconds per device-taken sample: SampleDecoder (caption, header, box), the
   tokenizer, collate (with the placeholder: earlier; without: now).
4. Overlap: a decoder and a step each sleeping 20 ms, through the Prefetcher (decoding on its thread) and
   one after the other (the earlier code's CPU path): wall per step.

Writes bench_results/device_step.json (ratio: per-image / batched operator calls per batch at B = 256,
the launch count a GPU pays on the host; the CPU's host ms, where the operators also compute, beside it).
"""

from __future__ import annotations

import argparse
import functools
import io
import random
import time
from dataclasses import fields

import torch
from PIL import Image

from benchlib import table, write_result  # a sibling: the script's folder is on sys.path


def per_image_crop(images, boxes, size, out):
    """The earlier DeviceDecoder's crop, as it ran on CUDA: one resized_crop and one copy per image."""
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.v2 import functional as F

    for k, (img, box) in enumerate(zip(images, boxes)):
        top, left, h, w = box
        x = F.resized_crop(img.float(), top, left, h, w, list(size), interpolation=InterpolationMode.BICUBIC,
                           antialias=True)
        out[k] = x.clamp_(0, 255).round_().to(torch.uint8).permute(1, 2, 0)


def roi_align_crop(images, boxes, size, out):
    """The alternative the issue names: torchvision.ops.roi_align over the gathered boxes (adaptive
    sampling: each output pixel the average of ceil(box / output)^2 bilinear samples: a box filter,
    not the worker's bicubic), then rounded and normalised into the batch like the batched path."""
    from torchvision.ops import roi_align

    from mmpretrain.data.resample import crops, pad

    x = crops(pad(images), boxes).to(torch.float32)
    n = len(images)
    rois = torch.cat([torch.arange(n, dtype=torch.float32)[:, None], torch.zeros(n, 2),
                      boxes[:, [3, 2]].to(torch.float32)], 1)  # (k, x1, y1, x2, y2) in the crop's pixels
    out.copy_(roi_align(x, rois, list(size), spatial_scale=1.0, sampling_ratio=-1, aligned=True)
              .round_().clamp_(0, 255))


def count_ops(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.cpu_parent is None)


def host_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--photos", type=int, default=256)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    import torchvision.io as tio

    from mmpretrain.data.batch import collate
    from mmpretrain.data.crop import ResizedCrop
    from mmpretrain.data.decode import SampleDecoder, augmentation_seed
    from mmpretrain.data.device_decode import DeviceDecoder
    from mmpretrain.data.resample import pad
    from mmpretrain.testing.photos import make_jpegs

    S = args.image_size
    crop = ResizedCrop(S)
    jpegs, raws, boxes = [], [], []
    seed = 0
    while len(jpegs) < args.photos:  # photos whose drawn box the device takes
        for cap, jpg in make_jpegs(64, seed=seed):
            img = Image.open(io.BytesIO(jpg))
            key = f"{seed:03d}{len(raws):05d}"
            box = crop.sampler(img.width, img.height, random.Random(augmentation_seed(0, 0, key)))
            if crop.jpeg_reduction(box) == 1 and len(jpegs) < args.photos:
                jpegs.append(jpg)
                boxes.append(list(box))
                raws.append({"__key__": key, "jpg": jpg, "txt": cap.encode()})
        seed += 1
    decoded = [tio.decode_jpeg(torch.frombuffer(bytearray(j), dtype=torch.uint8), mode=tio.ImageReadMode.RGB)
               for j in jpegs]
    worker = torch.stack([crop.apply(Image.open(io.BytesIO(j)), tuple(b)) for j, b in zip(jpegs, boxes)])
    dec = DeviceDecoder(crop, "cpu", batched=True)  # the GPU's crop stage
    result: dict = {"photos": len(jpegs), "image_size": S, "crop_stage": {}}
    rows = []
    sizes = [b for b in (64, 256) if b <= len(jpegs)] or [len(jpegs)]
    for B in sizes:
        imgs, bx = decoded[:B], boxes[:B]
        old_out = torch.empty((B, S, S, 3), dtype=torch.uint8)
        new_out = torch.empty((B, 3, S, S))
        roi_out = torch.empty((B, 3, S, S))
        old = functools.partial(per_image_crop, imgs, bx, (S, S), old_out)
        new = functools.partial(dec.crop_stage, new_out, imgs, torch.tensor(bx), torch.arange(B))
        roi = functools.partial(roi_align_crop, imgs, torch.tensor(bx), (S, S), roi_out)
        entry = {}
        for name, fn, pixels in (("per-image", old, old_out.permute(0, 3, 1, 2)), ("batched", new, new_out),
                                 ("roi_align", roi, roi_out)):
            ops, ms = count_ops(fn), host_ms(fn, args.repeats)
            diff = (pixels.float() - worker[:B].permute(0, 3, 1, 2).float()).abs()  # a view: read after fn
            entry[name] = {"ops": ops, "host_ms": round(ms, 2), "diff_mean": round(float(diff.mean()), 4),
                           "diff_max": float(diff.max())}
            rows.append((B, name, ops, f"{ms:.1f}", f"{float(diff.mean()):.3f}", f"{float(diff.max()):.0f}"))
        result["crop_stage"][str(B)] = entry
    padded = pad(decoded[:256])
    N, _, H, W = padded.shape
    h, w = (int(v) for v in torch.tensor(boxes[:256])[:, 2:].max(0).values)
    result["batched_memory_at_256"] = {
        "padded": [N, 3, H, W], "largest_box": [h, w],
        "uint8_mb": round(N * 3 * (H * W + h * W + h * w) / 1e6, 1), "float_crops_mb": round(N * 3 * h * w * 4 / 1e6, 1),
        "horizontal_pass_mb": round(N * 3 * h * S * 4 / 1e6, 1), "gflop": round(N * 3 * h * w * 2 * S * 2 / 1e9, 1)}
    print(table(rows, ("B", "crop stage", "operator calls", "host ms/batch", "mean |diff| vs worker",
                       "max |diff|")))
    print(f"batched memory at B=256: {result['batched_memory_at_256']}")

    # 2. shared memory per batch, 3. worker-side cost per device-taken sample
    from open_clip import get_tokenizer

    tok = get_tokenizer("ViT-B-32")
    sd = SampleDecoder(crop, embeddings="ignore", device_decode=True)
    B = min(256, len(raws))
    anchor = dict(sd(raws[0], 0, 0, anchor=True), index=0)
    items = [anchor] + [dict(sd(r, 0, 0), index=i) for i, r in enumerate(raws[1:B], 1)]
    placeholder = [it if "image" in it else dict(it, image=torch.zeros((S, S, 3), dtype=torch.uint8)) for it in items]

    def shm_bytes(batch) -> int:
        parts = [getattr(batch, f.name) for f in fields(batch)]
        parts += [getattr(batch.jpeg, f.name) for f in fields(batch.jpeg)] if batch.jpeg is not None else []
        return sum(v.numel() * v.element_size() for v in parts if isinstance(v, torch.Tensor))

    before, after = shm_bytes(collate(placeholder, tok)), shm_bytes(collate(items, tok))
    result["shm_bytes_per_batch"] = {"batch": B, "earlier": before, "now": after}
    print(f"bytes per batch of {B} through shared memory: earlier {before / 1e6:.1f} MB, now {after / 1e6:.1f} MB")

    def worker_side(with_placeholder: bool) -> float:
        t0 = time.perf_counter()
        its = [dict(sd(r, 0, 0), index=i) for i, r in enumerate(raws[1:B], 1)]
        if with_placeholder:
            its = [dict(it, image=torch.zeros((S, S, 3), dtype=torch.uint8)) for it in its]
        collate([anchor] + its, tok)
        return (time.perf_counter() - t0) / (B - 1) * 1e6

    us = {"earlier": min(worker_side(True) for _ in range(args.repeats)),
          "now": min(worker_side(False) for _ in range(args.repeats))}
    result["worker_us_per_device_sample"] = {k: round(v, 1) for k, v in us.items()}
    print(f"worker-side µs per device-taken sample (decoder + tokenizer + collate): earlier {us['earlier']:.0f}, "
          f"now {us['now']:.0f}")

    # 4. overlap
    from mmpretrain.data.device_decode import Prefetcher

    class Slow:
        device = torch.device("cpu")

        def __call__(self, batch):
            time.sleep(0.02)
            batch["images"] = torch.zeros(1)
            return batch

    n = 20
    t0 = time.perf_counter()
    it = Prefetcher([{"k": k} for k in range(n)], Slow())
    for _ in range(n):
        next(it)
        time.sleep(0.02)
    threaded = (time.perf_counter() - t0) / n * 1e3
    t0 = time.perf_counter()
    for k in range(n):
        Slow()({"k": k})
        time.sleep(0.02)
    serial = (time.perf_counter() - t0) / n * 1e3
    result["overlap_ms_per_step"] = {"decode_ms": 20, "step_ms": 20, "one_after_the_other": round(serial, 1),
                                     "prefetcher_thread": round(threaded, 1)}
    print(f"20 ms decode + 20 ms step: {serial:.1f} ms per step one after the other, {threaded:.1f} ms with the "
          "decoding thread")
    at = result["crop_stage"][str(sizes[-1])]
    ratio = at["per-image"]["ops"] / at["batched"]["ops"]
    path = write_result("device_step", ratio, True, None, [ratio], result)
    print(f"crop stage at B={sizes[-1]}: per-image / batched operator calls = {ratio:.1f} -> {path}")


if __name__ == "__main__":
    main()
