"""The GPU check (run by scripts/bench/bench_gpu.sh on a lent GPU machine; its CPU path runs in `make test-slow`).

    python scripts/bench/gpu_bench.py --data DATASET_DIR --out DIR [--sections step jpeg_faults crop_stage loss_memory precision
                                                                             engines kmeans]
                                [--model ViT-B-32] [--batch-size 256] [--steps 20] [--repeats 3]
                                [--e2e-steps 20] [--e2e-images 4096] [--e2e-workers N] [--budget 240]
                                [--loss-batch 65536] [--device cuda] [--precision bf16] [--peak-tflops N]
                                [--engines ddp fsdp deepspeed] [--engine-wrapper SCRIPT]

DATASET_DIR is a built and embedded dataset folder (``train/``, ``test/``; ``make gpu-bundle`` builds one
small enough to carry). gpu.json in DIR starts with the versions that run (the machine's own or the
bundle's) and gains each section as soon as it finishes, so a run cut short keeps what it measured.
Sections run in this order (by value: what only a GPU can show first); one whose estimate (ESTIMATE_S,
one H200) would end past --budget seconds is skipped and says so:

  step         our real ``train_step`` -- the project's own ``setup`` (loader, uint8 batch normalised on
               the device, text trimmed on the host, fused AdamW, clamp) -- against open_clip_train's
               ``train_one_epoch`` body (``ClipLoss``, torch's default AdamW, float batch normalised on
               the host, full-length tokens) on the same batch; samples/s and model-FLOP utilisation:
               FLOPs of one step counted by torch.utils.flop_counter (each side its own: ours runs the
               trimmed text) x steps/s / the device's dense bf16 peak (from its name, or --peak-tflops).
               Blocks alternate (ABBA) and the median of --repeats is reported. Then end to end
               (gpu_end_to_end.py): whole steps from --e2e-images photo JPEGs made on the machine (224 px),
               ours with data.decode=worker and data.decode=device against open_clip_train's loader + step.
  jpeg_faults  the device decoder on a JPEG cut short (ending in EOI), a progressive one cut in its first
               scan and one with broken Huffman tables: whether nvJPEG raises, fills with libjpeg's grey or
               returns other pixels, and what DeviceDecoder counts (``rule_holds``: the truncated_jpeg rule
               of mmpretrain/data/jpeg.py finds the cut ones on the device as on the host).
  crop_stage   data.decode=device's crop stage on 256 photos (224 px) the device takes: per-image (the
               earlier code) against batched (mmpretrain/data/resample.py), host ms to issue and device ms to
               finish a batch, pixel difference from the worker path, the nvJPEG backend, the decode's ms.
  loss_memory  peak CUDA memory above the inputs of one forward + backward of the tiled clip objective
               and of open_clip's ClipLoss at B = --loss-batch (D = 512).
  precision    every objective (tiled and not) under autocast in bf16 against fp32 on the device: relative
               error of value and feature gradient (mmpretrain/testing/precision.py, the CPU test's cases).
  engines      ``accelerate launch`` with configs/accelerate/{fsdp,deepspeed-zero2}.yaml (``--engines ddp`` adds
               1gpu.yaml), 1 process:
               train 6 steps (checkpoints at 3 and 6) and resume to 8 with each; ``mmpretrain.export`` of
               the FSDP and DeepSpeed runs, ``mmpretrain.eval`` of the FSDP run (STAGES: 6 cold launches);
               torch AdamW throughout (DeepSpeed wraps it in its ZeRO-2 optimizer). --engine-wrapper runs
               the FSDP/DeepSpeed launches through a script (the CPU test passes
               tests/scripts/gpu_engine_on_cpu.py, since accelerate refuses those engines without a GPU).
  kmeans       region weighting's k-means (mmpretrain.losses.clusters.kmeans: scikit-learn on the host)
               against a deterministic torch Lloyd on the device, 16,384 x 1,024 at 5, 10 and 20 centroids,
               warm-started as every refresh after the first is and cold: seconds and inertia.

``--device cpu`` with the tiny model runs every section's code (tests/test_gpu_bench.py). The code paths
use only APIs present in both the device image's torch 2.11 / torchvision 0.26 and this project's pins.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its siblings: gpu_common, gpu_end_to_end
from gpu_common import ROOT, count_flops, sync  # noqa: E402  (also puts the checkout on sys.path)

# dense bf16 tensor-core peaks (TFLOP/s, no sparsity) by device name; --peak-tflops overrides
PEAKS = {"H200": 989.0, "H100": 989.0, "GH200": 989.0, "B200": 2250.0, "A100": 312.0, "A10G": 125.0, "L40S": 362.0,
         "L4": 121.0, "A6000": 155.0, "4090": 165.0, "V100": 125.0}
ENGINES = {"ddp": "1gpu", "fsdp": "fsdp", "deepspeed": "deepspeed-zero2"}
# the stages each engine's smoke runs: every cold launch costs its imports, so evaluation (which reads
# any engine's consolidated checkpoint the same way) runs once, on the FSDP run
STAGES = {"ddp": ("train", "resume"), "fsdp": ("train", "resume", "eval", "export"),
          "deepspeed": ("train", "resume", "export")}


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
    from mmpretrain.models.factory import trim_padding
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
        for r in range(args.repeats):
            order = ("open_clip_train", "ours") if r % 2 == 0 else ("ours", "open_clip_train")
            blocks.append({k: timed(fns[k], args.steps, device) for k in order})
            print(f"step, block {r + 1}: " + ", ".join(f"{k} {args.batch_size / v:.0f} samples/s"
                                                       for k, v in blocks[-1].items()), flush=True)
        med = {k: sorted(b[k] for b in blocks)[len(blocks) // 2] for k in fns}
        peak, peak_source = peak_tflops(device, args.peak_tflops)
        mem = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        res = {"model": args.model, "batch_size": args.batch_size, "precision": args.precision,
               "tokens_open_clip": int(batch.tokens.shape[1]), "engine": str(acc.distributed_type),
               "tokens_ours": int(trim_padding(batch.tokens, cfg.train.text_length_multiple).shape[1]
                                  if run.task.trim_text else batch.tokens.shape[1]),
               "text_length_used": int((batch.tokens != 0).sum(1).max()),
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
            row[name] = {"warm_s": round(min(ts), 4), "warm_inertia": round(inertia(c), 3),
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
    from PIL import Image

    from mmpretrain.data.crop import ResizedCrop
    from mmpretrain.data.decode import augmentation_seed
    from mmpretrain.data.device_decode import DeviceDecoder, nvjpeg_backend
    from mmpretrain.testing.photos import make_jpegs

    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    from bench_device_step import per_image_crop

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

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    sync()
    t0 = time.perf_counter()
    images = dec._decode(blobs)
    sync()
    decode_ms = (time.perf_counter() - t0) * 1e3
    worker = torch.stack([crop.apply(Image.open(io.BytesIO(j)), tuple(b)) for j, b in zip(jpegs, boxes)])
    worker = worker.permute(0, 3, 1, 2).float()
    out = {"images": n, "nvjpeg_backend": nvjpeg_backend(device), "decode_ms": round(decode_ms, 1),
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
        sync()
        host, total = [], []
        for _ in range(3):
            sync()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            sync()
            host.append((t1 - t0) * 1e3)
            total.append((time.perf_counter() - t0) * 1e3)
        diff = (pixels().cpu() - worker).abs()
        out[name] = {"host_ms": round(min(host), 2), "device_ms": round(min(total), 2),
                     "diff_mean": round(float(diff.mean()), 4), "diff_max": float(diff.max())}
    return out


def io_jpeg(jpg: bytes, **kw) -> bytes:
    """``jpg`` saved again by Pillow with ``kw`` (e.g. progressive=True)."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.open(io.BytesIO(jpg)).save(buf, "JPEG", quality=90, **kw)
    return buf.getvalue()


def run_cmd(cmd: list[str], timeout: int) -> tuple[int, float, str]:
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
        return r.returncode, time.perf_counter() - t0, (r.stdout + r.stderr)[-2500:]
    except subprocess.TimeoutExpired as e:
        return 124, time.perf_counter() - t0, f"timed out after {timeout} s: {str(e.stderr)[-2000:]}"


def engine_smoke(engine: str, args, data: Path, work: Path) -> dict:
    run_dir = work / engine
    wrapper = args.engine_wrapper if engine != "ddp" and args.engine_wrapper else None
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
              str(ROOT / f"configs/accelerate/{ENGINES[engine]}.yaml"), "--num_processes", "1",
              "--mixed_precision", "no" if args.precision == "fp32" else args.precision]
    if engine == "fsdp" and args.device == "cpu":
        launch += ["--fsdp_sync_module_states", "false"]  # it broadcasts from CUDA
    launch += [wrapper] if wrapper else ["-m"]
    common = ["mmpretrain.train", "--config", str(ROOT / "configs/tiny/soft_target.yaml"),
              f"data.train={data / 'train'}", f"run_dir={run_dir}", "train.epochs=null", "data.batch_size=32",
              "data.num_workers=1", "optim.warmup_steps=1", "train.log_every=1", "train.save_every=3",
              "train.progress=false", "train.log_with=[]", f"train.precision={args.precision}"]
    res: dict = {"config": f"configs/accelerate/{ENGINES[engine]}.yaml"}
    stages = [("train", [*launch, *common, "train.steps=6"]),
              ("resume", [*launch, *common, "train.steps=8"]),
              ("eval", [sys.executable, "-m", "mmpretrain.eval", "--model", str(run_dir), "--dataset",
                        str(data / "test"), "--task", "zeroshot_classification", "--output",
                        str(run_dir / "results.json"), "--num_workers", "1"]),
              ("export", [sys.executable, "-m", "mmpretrain.export", str(run_dir), "--out", str(run_dir / "export")])]
    stages = [(stage, cmd) for stage, cmd in stages if stage in STAGES[engine]]
    for stage, cmd in stages:
        rc, dt, tail = run_cmd(cmd, args.stage_timeout)
        res[stage] = {"rc": rc, "seconds": round(dt, 1)}
        if rc != 0:
            res[stage]["output_tail"] = tail
            break
        if stage == "resume":  # from what the run wrote, not what it printed (warnings can bury a line)
            res[stage].update(resumed_from_files(run_dir, first=6, last=8))
    log = run_dir / "log.jsonl"
    if log.is_file():
        recs = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
        res["losses"] = {r["step"]: round(r["loss"], 5) for r in recs if "loss" in r}
    if engine != "ddp":
        res["sharding"] = ("one process: FSDP runs NO_SHARD and ZeRO-2 partitions nothing here; sharded training, "
                           "checkpoints and resume are proven on 2 gloo ranks by tests/test_engines.py")
    if (run_dir / "results.json").is_file():
        res["acc1"] = next((v for k, v in _flat(json.loads((run_dir / "results.json").read_text())) if k.endswith("acc1")),
                           None)
    res["export_files"] = sorted(p.name for p in (run_dir / "export").iterdir()) if (run_dir / "export").is_dir() else []
    res["ok"] = all(res.get(s, {}).get("rc") == 0 for s, _ in stages) and res["resume"].get("resumed", False)
    return res


def resumed_from_files(run_dir: Path, first: int, last: int) -> dict:
    """Whether the second launch continued the first from its step-``first`` checkpoint to ``last``:
    log.jsonl holds each step 1..last once (a restart would repeat 1..first) and the checkpoint of
    ``last`` is complete beside ``first``'s."""
    log = run_dir / "log.jsonl"
    recs = [json.loads(x) for x in log.read_text().splitlines() if x.strip()] if log.is_file() else []
    steps = [r["step"] for r in recs if "loss" in r]
    done = sorted(int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step_*")
                  if (p / "train_state.json").is_file())
    ok = sorted(set(steps)) == list(range(1, last + 1)) and len(steps) == len(set(steps)) and {first, last} <= set(done)
    return {"resumed": ok, "logged_steps": steps, "checkpoints": done}


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat(v, f"{prefix}{k}/")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _flat(v, f"{prefix}{i}/")
    else:
        yield prefix.rstrip("/"), tree


# ------------------------------------------------------------------------------------------------- main

SECTIONS = ("step", "jpeg_faults", "crop_stage", "loss_memory", "precision", "engines", "kmeans")  # by value: what only a GPU shows first
# seconds each section is expected to take on one H200 at the defaults (the run's own budget check;
# gpu.json records what each took, to correct these): 240 s in all, the budget. step: ~25 s fixed-batch,
# ~20 s to make 36,864 photos (5.2 ms each on one core here, 16 processes there), 3 sides x (~8 s set-up
# + 138 steps at 1,300-2,000 images/s from 8 workers)
ESTIMATE_S = {"step": 130, "jpeg_faults": 5, "crop_stage": 10, "loss_memory": 10, "precision": 10, "engines": 60,
              "kmeans": 15}
MEASUREMENTS_E2E = ("photos", "ours_decode_worker", "ours_decode_device", "open_clip_train")
# TF32 per section: the step and the data path as users train (the trainer turns it on on a GPU, as
# open_clip_train does); the comparisons against fp32 in true fp32
TF32 = {"step": True, "jpeg_faults": True, "crop_stage": True, "loss_memory": False, "precision": False,
        "engines": None, "kmeans": False}  # engines: each launch's trainer sets its own
VERSIONED = ("torch", "torchvision", "transformers", "accelerate", "open_clip_torch", "webdataset", "pydantic",
             "deepspeed", "timm", "scikit-learn", "scikit-image", "typing_extensions", "numpy")


class Recorder:
    """gpu.json as it grows: each measurement runs on its own, and its result -- or its error with the
    traceback's last frames -- is written the moment it exists, so one failure takes nothing else with
    it and a run cut short keeps what it measured. ``fault``: a measurement (``section.name``) that
    raises at its start instead of running (the rehearsal's injected failure)."""

    def __init__(self, result: dict, path: Path, fault: str | None = None):
        self.result, self.path, self.fault, self.failed = result, path, fault, []

    def put(self, section: str, name: str | None, value: dict) -> dict:
        node = self.result["sections"].setdefault(section, {})
        if name is None:
            node.update(value)
        else:
            *parents, leaf = name.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
        save(self.result, self.path)
        return value

    def run(self, section: str, name: str | None, fn, *a, **kw) -> dict:
        key = f"{section}.{name}" if name else section
        t0 = time.perf_counter()
        try:
            if key == self.fault:
                raise RuntimeError(f"fault injected at {key} (--fault)")
            out = fn(*a, **kw)
            out = out if isinstance(out, dict) else {"value": out}
        except Exception as e:  # the error is the result; the other measurements go on
            import traceback

            traceback.print_exc()
            frames = traceback.extract_tb(e.__traceback__)[-4:]
            out = {"error": f"{type(e).__name__}: {e}"[:2000],
                   "traceback": [f"{Path(f.filename).name}:{f.lineno} in {f.name}: {f.line}" for f in frames]}
            self.failed.append(key)
        out["seconds"] = round(time.perf_counter() - t0, 1)
        if name is not None:  # a whole section's line is main's
            print(f"{key}: {'FAILED, ' if 'error' in out else ''}{out['seconds']} s -> {self.path}", flush=True)
        return self.put(section, name, out)


def end_to_end_measurements(rec: Recorder, args, device, peak: float | None) -> None:
    """The step section's end-to-end part: the photos, then each side as its own measurement."""
    from gpu_end_to_end import images_needed, open_clip_side, ours_side, photo_shards, summary

    B, W = args.batch_size, args.e2e_workers or max(1, min(8, (os.cpu_count() or 2) - 2))
    n = images_needed(B, W, args.e2e_steps, args.e2e_images)
    with tempfile.TemporaryDirectory() as tmp:
        photos = Path(tmp) / "photos"

        def make() -> dict:
            photo_shards(photos, n, B)
            return {"images": n, "workers": W, "batch_size": B, "image_size": 224, "model": args.model}

        if "error" in rec.run("step", "end_to_end.photos", make):
            return
        sides = {}
        for decode in ("worker", "device"):
            sides[f"ours_decode_{decode}"] = rec.run("step", f"end_to_end.ours_decode_{decode}", ours_side, args,
                                                     device, photos, decode, W, Path(tmp))
        sides["open_clip_train"] = rec.run("step", "end_to_end.open_clip_train", open_clip_side, args, device,
                                           photos, W)
        rec.put("step", "end_to_end.summary", summary(sides, B, peak))


def run_section(rec: Recorder, section: str, args, device, data: Path) -> None:
    from mmpretrain.train.engine import tf32, tf32_state

    want = TF32[section] and device.type == "cuda" if TF32[section] is not None else None
    with tf32(want) if want is not None else _nothing():
        rec.put(section, None, {"tf32": tf32_state() if want is not None else "each launch's trainer"})
        if section == "step":
            fixed = rec.run("step", "fixed_batch", step_section, args, device, data)
            if args.e2e_steps:  # after the fixed-batch models are freed
                end_to_end_measurements(rec, args, device, fixed.get("peak_tflops") or
                                        peak_tflops(device, args.peak_tflops)[0])
        elif section == "engines":
            with tempfile.TemporaryDirectory() as work:
                for engine in args.engines:
                    res = rec.run("engines", engine, engine_smoke, engine, args, data, Path(work))
                    if "error" not in res and not res["ok"]:
                        rec.failed.append(f"engines.{engine}")
        else:
            fn = {"jpeg_faults": jpeg_faults_section, "crop_stage": crop_stage_section,
                  "loss_memory": loss_memory_section, "precision": precision_section, "kmeans": kmeans_section}
            rec.run(section, None, fn[section], args, device)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def versions() -> dict:
    """What ran: each package's version and whether it is the machine's own or the bundle's
    (bench_gpu.sh installs only what the machine lacks, into MMPT_SITE)."""
    import importlib.metadata as m

    site = os.environ.get("MMPT_SITE", "/tmp/mmpt-site")
    out = {}
    for name in VERSIONED:
        try:
            dist = m.distribution(name)
        except m.PackageNotFoundError:
            out[name] = None
            continue
        where = str(dist.locate_file(""))
        out[name] = {"version": dist.version, "from": "bundle" if where.startswith(site) else "machine"}
    return out


def save(result: dict, path: Path) -> None:
    """gpu.json, replaced whole (a run cut short keeps the sections it finished)."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="a built, embedded dataset folder (train/, test/)")
    p.add_argument("--out", default=str(ROOT / "bench_results"))
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    p.add_argument("--model", default="ViT-B-32")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=20, help="steps per timed block")
    p.add_argument("--repeats", type=int, default=3, help="timed blocks per side")
    p.add_argument("--e2e-steps", type=int, default=100, help="timed end-to-end steps per side (0: none)")
    p.add_argument("--e2e-images", type=int, default=0,
                   help="photo JPEGs made for the end-to-end steps, at least (default: what one epoch of warm-up + "
                        "timed steps needs)")
    p.add_argument("--e2e-workers", type=int, default=0, help="loader workers (0: cores - 2, at most 8)")
    p.add_argument("--budget", type=float, default=240.0,
                   help="seconds: a section whose estimate would end past it is skipped (and says so)")
    p.add_argument("--loss-batch", type=int, default=65536)
    p.add_argument("--precision-batch", type=int, default=4096)
    p.add_argument("--kmeans-rows", type=int, default=16384)
    p.add_argument("--kmeans-dim", type=int, default=1024)
    p.add_argument("--device", default="cuda")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak of the device (default: by name)")
    p.add_argument("--engines", nargs="+", choices=list(ENGINES), default=["fsdp", "deepspeed"],
                   help="engine smoke runs (default fsdp deepspeed: 6 cold launches, ~60 s; the step section "
                        "already trains under plain accelerate on the GPU)")
    p.add_argument("--engine-wrapper", default=None, help="script the FSDP/DeepSpeed launches run through")
    p.add_argument("--stage-timeout", type=int, default=300)
    p.add_argument("--fault", default=None, metavar="SECTION[.MEASUREMENT]",
                   help="raise at the start of this measurement (the rehearsal's injected failure), e.g. "
                        "step.end_to_end.ours_decode_device")
    args = p.parse_args()
    known = [*(s for s in SECTIONS if s not in ("step", "engines")), "step.fixed_batch", *(f"step.end_to_end.{m}" for m in MEASUREMENTS_E2E),
             *(f"engines.{e}" for e in ENGINES)]
    if args.fault is not None and args.fault not in known:
        print(f"error: --fault {args.fault} names no measurement; one of: {', '.join(known)}", file=sys.stderr)
        return 2
    data = Path(args.data)
    missing = [s for s in ("train", "test") if not (data / s).is_dir()]
    if missing:
        print(f"error: {data} has no {' or '.join(missing)}/ folder; build one with `make gpu-bundle` "
              "(or data_tools build + embed)", file=sys.stderr)
        return 2
    import torch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device (use --device cpu for the smoke path)", file=sys.stderr)
        return 2
    if device.type == "cpu":
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        print(f"error: --out {out} is a file; give a folder (gpu.json is written into it)", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "versions": versions(), "command": " ".join(sys.argv),
                    "estimate_s": {k: ESTIMATE_S[k] for k in args.sections}, "sections": {}}
    print("versions: " + ", ".join(f"{k} {v['version']} ({v['from']})" for k, v in result["versions"].items() if v),
          flush=True)
    print(f"sections {' '.join(args.sections)}: estimated {sum(result['estimate_s'].values())} s on one H200 "
          f"(budget {args.budget:.0f} s)", flush=True)
    path = out / "gpu.json"
    save(result, path)  # the versions, before any section can fail
    rec = Recorder(result, path, args.fault)
    start = time.perf_counter()
    for section in sorted(args.sections, key=SECTIONS.index):
        t0 = time.perf_counter()
        if device.type == "cuda" and t0 - start + ESTIMATE_S[section] > args.budget:
            rec.put(section, None, {"skipped": f"estimated {ESTIMATE_S[section]} s would end past the "
                                               f"{args.budget:.0f} s budget at {t0 - start:.0f} s"})
            print(f"{section}: skipped ({result['sections'][section]['skipped']})", flush=True)
            continue
        run_section(rec, section, args, device, data)
        rec.put(section, None, {"seconds": round(time.perf_counter() - t0, 1)})
        failed = "FAILED, " if "error" in result["sections"][section] else ""
        print(f"{section}: {failed}{result['sections'][section]['seconds']} s -> {path}", flush=True)
    result["seconds"] = {k: v.get("seconds") for k, v in result["sections"].items()}
    save(result, path)
    if rec.failed:
        print(f"error: failed: {', '.join(rec.failed)} (the rest measured; see {path})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
