"""The step section's end-to-end part of the GPU check (scripts/bench/gpu_bench.py): whole training
steps from photo shards made on the machine, ours with ``data.decode=worker`` and ``=device`` against
open_clip_train's loader and step."""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import tempfile
import time
from pathlib import Path

from gpu_bench import ROOT, timed


def photo_shards(folder: Path, n: int, per_shard: int) -> Path:
    """``n`` photo JPEGs (mmpretrain.testing.photos: scikit-image's and scikit-learn's photos, shorter side
    256-512 px) in shards, made here in parallel: the carry to a device machine is too small for them."""
    from concurrent.futures import ProcessPoolExecutor

    from mmpretrain.testing.photos import make_jpegs, write_shards

    chunks = [min(per_shard, n - i) for i in range(0, n, per_shard)]
    # spawned, not forked: this process has initialised CUDA
    with ProcessPoolExecutor(min(len(chunks), os.cpu_count() or 1), mp_context=mp.get_context("spawn")) as pool:
        parts = list(pool.map(make_jpegs, chunks, range(len(chunks))))
    write_shards([s for part in parts for s in part], folder, per_shard)
    return folder


def reset_accelerate() -> None:
    """A second ``setup`` in this process: accelerate's state is a per-process singleton."""
    import gc

    import torch
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def end_to_end(args, device, flops: int | None, peak: float | None) -> dict:
    """Whole training steps from photo shards at 224 px (read, decode, crop, hand-over, step): ours as
    ``fit`` runs them with ``data.decode=worker`` and ``data.decode=device``, and open_clip_train's
    ``get_wds_dataset`` + its step (float batches normalised in the workers). Samples/s over
    --e2e-steps after 3 warm-up steps; MFU from the fixed-batch step's FLOPs."""
    from argparse import Namespace

    import open_clip
    import torch
    from open_clip.loss import ClipLoss as OpenClipLoss

    from mmpretrain.config import load_config
    from mmpretrain.data.device_decode import Prefetcher, nvjpeg_backend
    from mmpretrain.train import setup, train_step

    B, W = args.batch_size, args.e2e_workers or max(1, min(8, (os.cpu_count() or 2) - 2))
    n = max(args.e2e_images, 2 * W * B)  # open_clip's workers each need whole batches of their shards
    t0 = time.perf_counter()
    res: dict = {"model": args.model, "batch_size": B, "workers": W, "images": n, "image_size": 224}
    with tempfile.TemporaryDirectory() as tmp:
        photos = photo_shards(Path(tmp) / "photos", n, B)
        res["make_photos_s"] = round(time.perf_counter() - t0, 1)
        rates = {}
        for decode in ("worker", "device"):
            reset_accelerate()
            cfg = load_config(ROOT / "configs/tiny/clip.yaml", [
                f"data.train={photos}", f"model.arch={args.model}", f"data.batch_size={B}", "train.epochs=null",
                "train.steps=1000000", "train.progress=false", "train.log_with=[]", f"data.num_workers={W}",
                f"train.precision={args.precision}", f"run_dir={tmp}/{decode}", "optim.warmup_steps=1",
                f"data.decode={decode}"])
            run = setup(cfg)
            it = run.images.batches(run.loader)

            def ours(run=run, it=it):
                batch = next(it)
                run.state.skipped.update(batch["skipped"])
                run.state.samples += len(batch["keys"])
                train_step(run, batch)
                run.state.step += 1

            for _ in range(3):
                ours()
            rates[f"ours_decode_{decode}"] = B / timed(ours, args.e2e_steps, device)
            print(f"end to end, ours, data.decode={decode}: {rates[f'ours_decode_{decode}']:.0f} samples/s", flush=True)
            if decode == "device":  # a "device" figure is the device's only if the device decoded the images
                counts = run.state.skipped
                res["device_path"] = {"nvjpeg_backend": nvjpeg_backend(run.accelerator.device),
                                      "device_decoded": counts.get("device_decoded", 0),
                                      "device_decode_fallback": counts.get("device_decode_fallback", 0),
                                      "samples": run.state.samples}
            if isinstance(it, Prefetcher):
                it.close()
            it = run = None  # the loader's workers and the model go before the next side's
        reset_accelerate()
        try:
            from open_clip_train.data import get_wds_dataset  # it imports pandas, which the machine may lack
        except ImportError as e:
            res["open_clip_train"] = {"error": f"{type(e).__name__}: {e}"}
            return _finish(res, rates, flops, peak, B)
        torch.manual_seed(0)
        model, preprocess, _ = open_clip.create_model_and_transforms(args.model, device=device, output_dict=True)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.1)
        loss_fn = OpenClipLoss()
        a = Namespace(train_data=str(photos / f"photo-{{000000..{len(list(photos.glob('*.tar'))) - 1:06d}}}.tar"),
                      train_num_samples=None, dataset_resampled=False, train_data_upsampling_factors=None, seed=0,
                      batch_size=B, world_size=1, workers=W)
        info = get_wds_dataset(a, preprocess, is_train=True, epoch=0, tokenizer=open_clip.get_tokenizer(args.model))

        def batches():
            for epoch in range(10**6):
                info.set_epoch(epoch)
                yield from info.dataloader

        feed = batches()

        def theirs():
            images, texts = next(feed)
            images, texts = images.to(device, non_blocking=True), texts.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16"):
                out = model(images, texts)
                loss = loss_fn(out["image_features"], out["text_features"], out["logit_scale"])
            loss.backward()
            opt.step()
            with torch.no_grad():
                model.logit_scale.clamp_(0, math.log(100))

        for _ in range(3):
            theirs()
        rates["open_clip_train"] = B / timed(theirs, args.e2e_steps, device)
        print(f"end to end, open_clip_train: {rates['open_clip_train']:.0f} samples/s", flush=True)
    return _finish(res, rates, flops, peak, B)


def _finish(res: dict, rates: dict, flops: int | None, peak: float | None, B: int) -> dict:
    res["samples_per_s"] = {k: round(v, 1) for k, v in rates.items()}
    res["device_over_worker"] = round(rates["ours_decode_device"] / rates["ours_decode_worker"], 4)
    if "open_clip_train" in rates:
        res["ours_device_over_open_clip"] = round(rates["ours_decode_device"] / rates["open_clip_train"], 4)
    if flops and peak:
        res["mfu"] = {k: round(flops * v / B / (peak * 1e12), 4) for k, v in rates.items()}
    return res
