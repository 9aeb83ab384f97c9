"""The step section's end-to-end part of the GPU check (scripts/bench/gpu_bench.py): whole training
steps from photo shards made on the machine, ours with ``data.decode=worker`` and ``=device`` against
open_clip_train's loader and step, each side its own measurement (one failing leaves the others).

Every side runs inside one epoch of its loader: warm-up (at least two full prefetch rounds, so the
workers' first fill is not timed), the timed steps and the few steps that count host syncs all come
out of epoch 0 (:func:`images_needed`); an epoch boundary, where open_clip's loader refills, is never
timed. Per-step times come from CUDA events recorded between steps (read after the window: no host
sync per step), the data-wait share from the host time spent fetching the next batch."""

from __future__ import annotations

import gc
import math
import multiprocessing as mp
import os
import statistics
import threading
import time
import warnings
from pathlib import Path

from gpu_common import ROOT, count_flops, sync  # a sibling: the script's folder is on sys.path

SYNC_STEPS = 5  # steps run under torch.cuda.set_sync_debug_mode after the timed window
PREFETCH = 2  # data.prefetch_factor's default, and open_clip_train's loader's


def e2e_workers(args) -> int:
    """The end-to-end sides' loader workers: --e2e-workers, else cores - 2, at most 8."""
    return args.e2e_workers or max(1, min(8, (os.cpu_count() or 2) - 2))


def warmup_steps(workers: int) -> int:
    """Two full prefetch rounds of every worker: the loader's start-up fill is spent before timing."""
    return 2 * max(1, workers) * PREFETCH


def images_needed(batch: int, workers: int, steps: int, at_least: int = 0) -> int:
    """Photos for one epoch that holds warm-up + timed + sync-count steps on every side, in whole
    batches per worker (open_clip's loader splits shards of one batch each between its workers)."""
    batches = warmup_steps(workers) + steps + SYNC_STEPS + 1
    batches = max(batches, -(-at_least // batch))
    return -(-batches // workers) * workers * batch


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
    import torch
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class StepClock:
    """Step boundaries: CUDA events recorded on the current stream (read after the window, so timing
    adds no host sync), or the wall clock on a CPU (where every operator is synchronous)."""

    def __init__(self, device):
        import torch

        self.cuda = device.type == "cuda"
        self.marks: list = []
        self._event = (lambda: torch.cuda.Event(enable_timing=True)) if self.cuda else None

    def mark(self) -> None:
        if self.cuda:
            ev = self._event()
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    def intervals_ms(self) -> list[float]:
        pairs = zip(self.marks, self.marks[1:])
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) for a, b in pairs]
        return [(b - a) * 1e3 for a, b in pairs]


def spread(ms: list[float]) -> dict:
    q = statistics.quantiles(ms, n=10, method="inclusive") if len(ms) >= 2 else ms * 9
    return {"median": round(statistics.median(ms), 3), "p10": round(q[0], 3), "p90": round(q[-1], 3),
            "min": round(min(ms), 3), "max": round(max(ms), 3)}


def timed_window(step, fetch, batch: int, warmup: int, steps: int, device) -> dict:
    """``warmup`` untimed steps, then ``steps`` timed ones: samples/s over the window's wall time, the
    per-step times (median and spread) and the share of the window the host spent waiting for data."""
    for _ in range(warmup):
        step(fetch())
    sync(device)
    clock, wait = StepClock(device), 0.0
    t0 = time.perf_counter()
    clock.mark()
    for _ in range(steps):
        a = time.perf_counter()
        b = fetch()
        wait += time.perf_counter() - a
        step(b)
        clock.mark()
    sync(device)
    wall = time.perf_counter() - t0
    return {"warmup_steps": warmup, "timed_steps": steps, "wall_s": round(wall, 3),
            "samples_per_s": round(batch * steps / wall, 1), "step_ms": spread(clock.intervals_ms()),
            "data_wait_share": round(wait / wall, 4)}


def syncs_per_step(step, fetch, device, n: int = SYNC_STEPS) -> dict:
    """Per step of the training thread, over ``n`` steps: ``syncs c10 reports`` (under
    torch.cuda.set_sync_debug_mode("warn"); the decoding thread's own are not counted) and ``pageable
    copies`` (host-to-device copies from pageable or non-contiguous memory, which make the stream wait
    for the host without c10 reporting it; mmpretrain.testing.copies). None on a CPU: nothing to sync with."""
    if device.type != "cuda":
        for _ in range(n):  # the same batches are consumed, so the epoch arithmetic holds on any device
            step(fetch())
        return {"syncs c10 reports": None, "pageable copies": None}
    import torch

    from mmpretrain.testing.copies import CopyAudit

    main, count, pageable = threading.get_ident(), [0], 0

    def show(message, category, *args, **kwargs):
        if threading.get_ident() == main and "synchroniz" in str(message):
            count[0] += 1

    with warnings.catch_warnings():  # the check's main thread, once around the window
        warnings.simplefilter("always")
        warnings.showwarning = show
        for _ in range(n):
            b = fetch()
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with CopyAudit(prefix="") as audit:  # every caller: open_clip_train's loop is not ours
                    step(b)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            pageable += sum(c.pageable for c in audit.copies)
    return {"syncs c10 reports": count[0] / n, "pageable copies": pageable / n}


def ours_side(args, device, photos: Path, decode: str, workers: int, tmp: Path) -> dict:
    """Our ``fit`` loop body with ``data.decode=decode``: its loader, image input and ``train_step``."""
    from mmpretrain.config import load_config
    from mmpretrain.data.device_decode import Prefetcher, nvjpeg_backend
    from mmpretrain.train import setup, train_step

    B = args.batch_size
    reset_accelerate()
    cfg = load_config(ROOT / "configs/tiny/clip.yaml", [
        f"data.train={photos}", f"model.arch={args.model}", f"data.batch_size={B}", "train.epochs=null",
        "train.steps=1000000", "train.progress=false", "train.log_with=[]", f"data.num_workers={workers}",
        f"train.precision={args.precision}", f"run_dir={tmp}/{decode}", "optim.warmup_steps=1",
        f"data.decode={decode}", f"data.prefetch_factor={PREFETCH}"])
    run = setup(cfg)
    it = run.images.batches(run.loader)
    epochs: set[int] = set()
    used = [0]
    try:
        def step(batch):
            epochs.add(int(batch.epoch))
            used[0] = max(used[0], int((batch.tokens != 0).sum(1).max()))  # the host copy: no sync
            run.state.skipped.update(batch.skipped)
            run.state.samples += len(batch.keys)
            train_step(run, batch)
            run.state.step += 1

        def fetch():
            return next(it)

        warm = warmup_steps(workers)
        flops = count_flops(lambda: step(fetch()))  # the first warm-up step, counted
        res = timed_window(step, fetch, B, warm - 1, args.e2e_steps, device)
        res["flops_per_step"] = flops
        res["syncs_per_step"] = syncs_per_step(step, fetch, device)
        res["epochs"] = sorted(epochs)
        res["text_length_used"] = used[0]
        if decode == "device":  # a "device" figure is the device's only if the device decoded the images
            counts = run.state.skipped
            done, fallback = counts.get("device_decoded", 0), counts.get("device_decode_fallback", 0)
            res["device_path"] = {"nvjpeg_backend": nvjpeg_backend(run.accelerator.device), "device_decoded": done,
                                  "device_decode_fallback": fallback,
                                  "undecodable_image": counts.get("undecodable_image", 0), "samples": run.state.samples}
            share = fallback / max(1, done + fallback)
            res["device_path"]["fallback_share"] = round(share, 4)
            if share > 0.1:
                res["label"] = (f"{share:.0%} of the device-taken JPEGs were decoded on the host: not the device "
                                "decoder's rate")
    finally:
        if isinstance(it, Prefetcher):
            it.close()
        it = run = None  # the loader's workers and the model go before the next side's
        reset_accelerate()
    return res


def open_clip_side(args, device, photos: Path, workers: int) -> dict:
    """open_clip_train's ``get_wds_dataset`` (float batches normalised in the workers) and its step:
    ``ClipLoss``, torch's AdamW, full-length tokens, the logit-scale clamp. One epoch of its loader."""
    from argparse import Namespace

    import open_clip
    import torch
    from open_clip.loss import ClipLoss as OpenClipLoss
    from open_clip_train.data import get_wds_dataset  # it imports pandas, which the machine may lack

    B = args.batch_size
    reset_accelerate()
    torch.manual_seed(0)
    model, preprocess, _ = open_clip.create_model_and_transforms(args.model, device=device, output_dict=True)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.1)
    loss_fn = OpenClipLoss()
    shards = len(list(photos.glob("*.tar")))
    a = Namespace(train_data=str(photos / f"photo-{{000000..{shards - 1:06d}}}.tar"), train_num_samples=None,
                  dataset_resampled=False, train_data_upsampling_factors=None, seed=0, batch_size=B, world_size=1,
                  workers=workers)
    info = get_wds_dataset(a, preprocess, is_train=True, epoch=0, tokenizer=open_clip.get_tokenizer(args.model))
    info.set_epoch(0)
    feed = iter(info.dataloader)  # one epoch: running out of it is an error, never a refill inside the window
    used = [0]
    try:
        def fetch():
            used[0] += 1
            return next(feed)

        def step(batch):
            images, texts = batch
            images, texts = images.to(device, non_blocking=True), texts.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16"):
                out = model(images, texts)
                loss = loss_fn(out["image_features"], out["text_features"], out["logit_scale"])
            loss.backward()
            opt.step()
            with torch.no_grad():
                model.logit_scale.clamp_(0, math.log(100))

        warm = warmup_steps(workers)
        flops = count_flops(lambda: step(fetch()))
        res = timed_window(step, fetch, B, warm - 1, args.e2e_steps, device)
        res["flops_per_step"] = flops
        res["syncs_per_step"] = syncs_per_step(step, fetch, device)
        res["epoch_batches"], res["batches_used"] = info.dataloader.num_batches, used[0]
    finally:
        feed = info = model = opt = None
        reset_accelerate()
    return res


def summary(sides: dict, batch: int, peak: float | None) -> dict:
    """Ratios between the sides that finished, and each one's MFU from its own FLOPs."""
    rate = {k: v["samples_per_s"] for k, v in sides.items() if isinstance(v, dict) and "samples_per_s" in v}
    used = [v["text_length_used"] for v in sides.values() if isinstance(v, dict) and "text_length_used" in v]
    out: dict = {"samples_per_s": rate, "text_length_used": max(used) if used else None}
    if "ours_decode_device" in rate and "ours_decode_worker" in rate:
        out["device_over_worker"] = round(rate["ours_decode_device"] / rate["ours_decode_worker"], 4)
    for ours in ("ours_decode_worker", "ours_decode_device"):
        if ours in rate and "open_clip_train" in rate:
            out[f"{ours}_over_open_clip"] = round(rate[ours] / rate["open_clip_train"], 4)
    if peak:
        out["mfu"] = {k: round(sides[k]["flops_per_step"] * r / batch / (peak * 1e12), 4) for k, r in rate.items()}
    return out
