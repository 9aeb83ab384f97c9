"""The GPU check's measuring sections (scripts/bench/gpu_bench.py runs them and documents each): step,
loss_memory, precision, kmeans, jpeg_faults, crop_stage. Each takes the parsed arguments and the device
and returns its result as a dict."""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

from gpu_common import ROOT, count_flops, device_times, sync

# dense bf16 tensor-core peaks (TFLOP/s, no sparsity) by device name; --peak-tflops overrides
PEAKS = {"H200": 989.0, "H100": 989.0, "GH200": 989.0, "B200": 2250.0, "A100": 312.0, "A10G": 125.0, "L40S": 362.0,
         "L4": 121.0, "A6000": 155.0, "4090": 165.0, "V100": 125.0}


def peak_tflops(device, override: float | None) -> tuple[float | None, str]:
    if override is not None:
        return override, "--peak-tflops"
    if device.type != "cuda":
        return None, "cpu: no peak"
    import torch

    name = torch.cuda.get_device_name(device)
    for key, value in PEAKS.items():
        if key in name:
            return value, f"{name} (table)"
    return None, f"{name}: not in the table (pass --peak-tflops)"


def timed(fn, steps: int, device) -> float:
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / steps


# ------------------------------------------------------------------------------------------------ step

def step_section(args, device, data: Path) -> dict:
    import open_clip
    import torch
    from gpu_end_to_end import syncs_per_step
    from open_clip.loss import ClipLoss as OpenClipLoss

    from mmpretrain.config import load_config
    from mmpretrain.data.decode import DeviceNormalize
    from mmpretrain.models.text import trim_padding
    from mmpretrain.train import setup, train_step

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(ROOT / "configs/tiny/clip.yaml", [
            f"data.train={data / 'train'}", f"model.arch={args.model}", f"data.batch_size={args.batch_size}",
            "train.epochs=null", "train.steps=1000000", "train.progress=false", "train.log_with=[]",
            f"train.precision={args.precision}", f"run_dir={tmp}/ours", "data.num_workers=2", "optim.warmup_steps=1"])
        run = setup(cfg)
        batch = next(iter(run.loader))
        acc = run.accelerator

        def ours():
            train_step(run, batch)
            run.state.step += 1

        # open_clip_train's step on the same samples: the batch as its loader gives it (float, normalised
        # on the host), full-length tokens, ClipLoss, torch's default AdamW, the clamp
        images = batch.images
        norm = run.images.normalize
        if norm is not None:  # the same normalisation, on the host (a copy: the run's stays on the device)
            images = DeviceNormalize(norm.mean.cpu(), norm.std.cpu(), norm.channels_last)(images)
        tokens = batch.tokens
        if device.type == "cuda":
            images, tokens = images.pin_memory(), tokens.pin_memory()
        torch.manual_seed(0)
        model = open_clip.create_model(args.model, device=device, output_dict=True)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.1)
        loss_fn = OpenClipLoss()

        def autocast():
            return torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")

        def forward_backward_theirs():
            im, tok = images.to(device, non_blocking=True), tokens.to(device, non_blocking=True)
            with autocast():
                out = model(im, tok)
                total = loss_fn(out["image_features"], out["text_features"], out["logit_scale"])
            total.backward()

        def theirs():
            opt.zero_grad(set_to_none=True)
            forward_backward_theirs()
            opt.step()
            with torch.no_grad():
                model.logit_scale.clamp_(0, math.log(100))

        flops = {"open_clip_train": count_flops(forward_backward_theirs)}
        opt.zero_grad(set_to_none=True)
        fns = {"open_clip_train": theirs, "ours": ours}
        for fn in fns.values():  # warm-up (cuDNN/cuBLAS autotuning, allocator)
            for _ in range(3):
                fn()
        flops["ours"] = count_flops(ours)
        blocks: list[dict[str, float]] = []
        used = int((batch.tokens != 0).sum(1).max())
        for r in range(args.repeats):
            order = ("open_clip_train", "ours") if r % 2 == 0 else ("ours", "open_clip_train")
            blocks.append({k: timed(fns[k], args.steps, device) for k in order})
            print(f"step, block {r + 1} (captions of at most {used} tokens): " + ", ".join(
                f"{k} {args.batch_size / v:.0f} samples/s" for k, v in blocks[-1].items()), flush=True)
        med = {k: sorted(b[k] for b in blocks)[len(blocks) // 2] for k in fns}
        peak, peak_source = peak_tflops(device, args.peak_tflops)
        mem = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        res = {"model": args.model, "batch_size": args.batch_size, "precision": args.precision,
               "tokens_open_clip": int(batch.tokens.shape[1]), "engine": str(acc.distributed_type),
               "tokens_ours": int(trim_padding(batch.tokens, cfg.train.text_length_multiple).shape[1]
                                  if run.task.trim_text else batch.tokens.shape[1]),
               "text_length_used": used,
               "flops_per_step": flops, "samples_per_s": {k: round(args.batch_size / v, 1) for k, v in med.items()},
               "ms_per_step": {k: round(v * 1000, 2) for k, v in med.items()},
               "speedup": round(med["open_clip_train"] / med["ours"], 4),
               "blocks": [round(b["open_clip_train"] / b["ours"], 4) for b in blocks],
               "peak_tflops": peak, "peak_source": peak_source, "max_memory_allocated": mem,
               "syncs_per_step": {k: syncs_per_step(lambda _b, f=f: f(), lambda: None, device) for k, f in fns.items()}}
        if peak:
            res["mfu"] = {k: round(flops[k] / med[k] / (peak * 1e12), 4) for k in fns}
    return res


# ------------------------------------------------------------------------------------------ loss_memory

def loss_memory_section(args, device, dim: int = 512, chunk: int = 4096) -> dict:
    import torch
    import torch.nn.functional as F
    from open_clip.loss import ClipLoss as OpenClipLoss

    from mmpretrain.losses import LOSSES

    res: dict = {"batch": args.loss_batch, "dim": dim, "chunk": chunk}
    for name, fn in (("ours_tiled", lambda x, y, s: LOSSES["clip"](chunk_size=chunk)(
                         image_features=x, text_features=y, logit_scale=s)["clip_loss"]),
                     ("open_clip", lambda x, y, s: OpenClipLoss()(x, y, s))):
        g = torch.Generator().manual_seed(0)
        x = F.normalize(torch.randn(args.loss_batch, dim, generator=g), dim=-1).to(device).requires_grad_()
        y = F.normalize(torch.randn(args.loss_batch, dim, generator=g), dim=-1).to(device).requires_grad_()
        s = torch.tensor(14.3, device=device)
        try:
            base = 0
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            t0 = time.perf_counter()
            loss = fn(x, y, s)
            loss.backward()
            sync(device)
            dt = time.perf_counter() - t0
            peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
            res[name] = {"peak_bytes_above_inputs": peak, "seconds": round(dt, 4), "loss": float(loss.detach()),
                         "grad_norm": float(x.grad.norm())}
        except torch.OutOfMemoryError as e:
            res[name] = {"error": f"out of memory: {str(e)[:200]}"}
        del x, y
    if "loss" in res["ours_tiled"] and "loss" in res["open_clip"]:
        res["loss_rel_diff"] = abs(res["ours_tiled"]["loss"] - res["open_clip"]["loss"]) / abs(res["open_clip"]["loss"])
    return res


# -------------------------------------------------------------------------------------------- precision

def precision_section(args, device) -> dict:
    import torch

    from mmpretrain.testing.precision import agreement, amp_cases, structured_batch

    n, d, e = args.precision_batch, 256, 128
    batch = structured_batch(n, d, e, device)
    res = {"batch": n, "dim": d, "target_dim": e, "dtype": "bf16", "cases": {}}
    for name, options, chunk in amp_cases(max(n // 4, 1)):
        key = name + "".join(f" {k}={v}" for k, v in options.items()) + (f" chunk={chunk}" if chunk else "")
        res["cases"][key] = {k: round(v, 6) for k, v in agreement(name, options, chunk, batch, torch.bfloat16).items()}
    res["max_grad_rel"] = max(c["grad_rel"] for c in res["cases"].values())
    res["max_loss_rel"] = max(c["loss_rel"] for c in res["cases"].values())
    return res


# ----------------------------------------------------------------------------------------------- kmeans

def kmeans_torch(bank, m: int, init, iters: int, seed: int, tol: float = 1e-4):
    """Lloyd's k-means in torch on ``bank``'s device, scikit-learn's stopping rule (centre shift² <= tol x
    mean feature variance), k-means++ seeding from a CPU generator when ``init`` is None. Deterministic:
    assignments by argmin, sums by a one-hot matrix product (no atomics)."""
    import torch

    x = bank.detach().float()
    n = x.shape[0]
    if init is None:
        g = torch.Generator().manual_seed(seed)
        idx = [int(torch.randint(n, (1,), generator=g))]
        d2 = ((x - x[idx[0]]) ** 2).sum(1)
        for _ in range(1, m):
            p = d2.clamp_min(0).double().cpu()
            j = int(torch.multinomial(p / p.sum(), 1, generator=g))
            idx.append(j)
            d2 = torch.minimum(d2, ((x - x[j]) ** 2).sum(1))
        c = x[idx].clone()
    else:
        c = init.detach().float().clone()
    threshold = tol * float(x.var(0).mean())
    for _ in range(iters):
        a = ((c * c).sum(1)[None] - 2 * x @ c.T).argmin(1)
        onehot = torch.nn.functional.one_hot(a, m).to(x.dtype)
        counts = onehot.sum(0)
        new = torch.where(counts[:, None] > 0, (onehot.T @ x) / counts.clamp_min(1)[:, None], c)
        shift = float(((new - c) ** 2).sum())
        c = new
        if shift <= threshold:
            break
    return c


def kmeans_section(args, device) -> dict:
    import torch
    import torch.nn.functional as F

    from mmpretrain.losses.clusters import kmeans

    n, d = args.kmeans_rows, args.kmeans_dim
    g = torch.Generator().manual_seed(0)
    centers = F.normalize(torch.randn(50, d, generator=g), dim=-1)
    bank = F.normalize(centers[torch.randint(50, (n,), generator=g)] + 0.05 * torch.randn(n, d, generator=g), dim=-1)
    bank = bank.to(device)

    def inertia(c) -> float:
        return float(torch.cdist(bank, c.to(bank)).pow(2).min(1).values.sum())

    res: dict = {"rows": n, "dim": d, "iters": 20, "scales": {}}
    for m in (5, 10, 20):
        init = kmeans(bank[: n // 4], m, None, 20, 0)  # a warm start, as every refresh after the first
        row = {}
        for name, fn in (("sklearn", kmeans), ("torch", kmeans_torch)):
            fn(bank, m, init, 20, 1)
            ts = []
            for _ in range(3):
                sync(device)
                t0 = time.perf_counter()
                c = fn(bank, m, init, 20, 1)
                sync(device)
                ts.append(time.perf_counter() - t0)
            sync(device)
            t0 = time.perf_counter()
            cold = fn(bank, m, None, 20, 1)
            sync(device)
            row[name] = {"warm_s": round(sorted(ts)[1], 4), "warm_inertia": round(inertia(c), 3),  # median of 3
                         "cold_s": round(time.perf_counter() - t0, 4), "cold_inertia": round(inertia(cold), 3)}
        again = kmeans_torch(bank, m, init, 20, 1)
        row["torch_repeatable"] = bool(torch.equal(again, kmeans_torch(bank, m, init, 20, 1)))
        res["scales"][m] = row
        print(f"kmeans m={m}: " + ", ".join(f"{k} warm {v['warm_s']} s" for k, v in row.items() if isinstance(v, dict)),
              flush=True)
    res["warm_speedup_torch"] = {m: round(r["sklearn"]["warm_s"] / r["torch"]["warm_s"], 3) for m, r in res["scales"].items()}
    return res


# ---------------------------------------------------------------------------------------------- engines

def jpeg_faults_section(args, device) -> dict:
    """What the device's JPEG decoder (nvJPEG on CUDA) does with files whose data do not cover their frame
    and with broken Huffman tables, and what DeviceDecoder counts: the truncated_jpeg rule
    (mmpretrain/data/jpeg.py) rests on libjpeg's grey fill, seen on the host; here is whether the device
    raises (then the host decodes it and the rule holds), fills with grey (it holds) or returns other
    pixels (it does not)."""
    import torch
    import torchvision.io as tio

    from mmpretrain.data.batch import collate
    from mmpretrain.data.crop import ResizedCrop
    from mmpretrain.data.decode import SampleDecoder, SkipSample
    from mmpretrain.data.device_decode import DeviceDecoder
    from mmpretrain.data.jpeg import FILL, tail_box
    from mmpretrain.testing.photos import bad_huffman, cut_short, make_jpegs

    photos = make_jpegs(3, seed=11, short_side=(224, 320))
    prog = io_jpeg(photos[1][1], progressive=True)
    cases = {"photo": photos[2][1], "cut, ends in EOI": cut_short(photos[2][1]),
             "progressive, first scan cut": cut_short(prog, 0.03), "broken Huffman tables": bad_huffman(photos[2][1])}
    crop = ResizedCrop(224, scale=(0.9, 1.0))
    decoder, out = SampleDecoder(crop, embeddings="ignore", device_decode=True), {}
    for name, jpg in cases.items():
        try:
            img = tio.decode_jpeg(torch.frombuffer(bytearray(jpg), dtype=torch.uint8), mode=tio.ImageReadMode.RGB,
                                  device=device)
            top, left, bottom, right = tail_box(img.shape[-2], img.shape[-1])
            raw = f"pixels, last block grey: {bool((img[:, top:bottom, left:right] == FILL).all())}"
        except RuntimeError as e:
            raw = f"raised: {str(e).splitlines()[0][:200]}"
        raws = [{"__key__": "anchor", "jpg": photos[0][1], "txt": b"a"}, {"__key__": "k", "jpg": jpg, "txt": b"a"}]
        try:  # what the device does not take (progressive JPEGs) the worker decodes, and may skip
            batch = collate([dict(decoder(r, 0, 0, anchor=i == 0), index=i) for i, r in enumerate(raws)])
        except SkipSample as e:
            out[name] = {"device decode_jpeg": raw, "shipped to the device": False, "counted": {e.reason: 1}}
            continue
        shipped = batch.jpeg is not None
        DeviceDecoder(crop, device)(batch)
        out[name] = {"device decode_jpeg": raw, "shipped to the device": shipped,
                     "counted": {k: v for k, v in batch.skipped.items()
                                 if k not in ("repeated_in_batch", "device_decoded")}}
    want = {"photo": {}, "broken Huffman tables": {"undecodable_image": 1}}
    out["rule_holds"] = all(out[n]["counted"] == want.get(n, {"truncated_jpeg": 1}) for n in cases)
    return out


def crop_stage_section(args, device, n: int | None = None) -> dict:
    """data.decode=device's crop stage on the device, per-image (the earlier code) against batched (now):
    host ms to issue a batch, device ms to finish it (synchronised), pixel difference from the worker
    path, the nvJPEG backend and the batched decode's time -- the measurement the choice on the CPU
    (operator calls, scripts/bench/bench_device_step.py) stands in for."""
    import io
    import random

    import torch
    from bench_device_step import per_image_crop  # a sibling (the script's folder is on sys.path)
    from PIL import Image

    from mmpretrain.data.crop import ResizedCrop
    from mmpretrain.data.decode import augmentation_seed
    from mmpretrain.data.device_decode import DeviceDecoder, nvjpeg_backend
    from mmpretrain.testing.photos import make_jpegs

    n = n or (256 if device.type == "cuda" else 16)
    crop = ResizedCrop(224)
    jpegs, boxes, seed = [], [], 0
    while len(jpegs) < n:
        for _, jpg in make_jpegs(64, seed=seed):
            img = Image.open(io.BytesIO(jpg))
            box = crop.sampler(img.width, img.height, random.Random(augmentation_seed(0, 0, f"{seed}/{len(jpegs)}")))
            if crop.jpeg_reduction(box) == 1 and len(jpegs) < n:
                jpegs.append(jpg)
                boxes.append(list(box))
        seed += 1
    dec = DeviceDecoder(crop, device, batched=True)
    blobs = [torch.frombuffer(bytearray(j), dtype=torch.uint8) for j in jpegs]

    images = dec._decode(blobs)  # warm-up: nvJPEG's handles, the allocator
    decode = device_times(lambda: dec._decode(blobs), device)
    worker = torch.stack([crop.apply(Image.open(io.BytesIO(j)), tuple(b)) for j, b in zip(jpegs, boxes)])
    worker = worker.permute(0, 3, 1, 2).float()
    out = {"images": n, "nvjpeg_backend": nvjpeg_backend(device), "decode_ms": decode,
           "timing": "median of 3 after a warm-up; device_ms from CUDA events (wall time on a CPU)",
           "device_decode_failures": sum(im is None for im in images)}
    if out["device_decode_failures"]:
        return out
    old_out = torch.empty((n, 224, 224, 3), dtype=torch.uint8, device=device)
    new_out = torch.empty((n, 3, 224, 224), device=device)
    bx = torch.tensor(boxes)
    for name, fn, pixels in (("per_image", lambda: per_image_crop(images, boxes, (224, 224), old_out),
                              lambda: old_out.permute(0, 3, 1, 2).float()),
                             ("batched", lambda: dec.crop_stage(new_out, images, bx, torch.arange(n)), lambda: new_out)):
        fn()
        times = device_times(fn, device)
        diff = (pixels().cpu() - worker).abs()
        out[name] = {"host_ms": times["host_ms"], "device_ms": times["device_ms"],
                     "diff_mean": round(float(diff.mean()), 4), "diff_max": float(diff.max())}
    return out


def io_jpeg(jpg: bytes, **kw) -> bytes:
    """``jpg`` saved again by Pillow with ``kw`` (e.g. progressive=True)."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.open(io.BytesIO(jpg)).save(buf, "JPEG", quality=90, **kw)
    return buf.getvalue()
