"""Host memory of the training loader at a large batch: peak ``/dev/shm`` use and worker memory for
ours at ``data.prefetch_factor`` 4 (the earlier fixed value) and 2 (the default), against open_clip_train's
``get_wds_dataset`` (torch's default prefetch of 2, batches stacked in the worker's private memory).

    python scripts/bench/bench_host_memory.py [--batch-size 1024] [--image-size 224] [--workers 2]

Data: the packaged OpenMoji emoji as 256 px JPEG shards (``data_tools build demo:openmoji``) in a
temporary folder, read in resampled mode. The consumer takes one batch, then waits until ``/dev/shm``
stops growing for 15 s (every worker's queue full), sampling every 0.1 s: ``/dev/shm`` used, the workers'
RSS and USS (private bytes) summed, the main process's RSS; then reads the rest. Expected peak
``/dev/shm`` = (workers x prefetch + 2) x batch bytes (docs/scale.md). Writes
bench_results/host_memory.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from argparse import Namespace
from pathlib import Path

import psutil

from benchlib import RESULTS, table, trainer_plan

MIB = 2**20


def watch(it, settle: float = 15.0, limit: float = 300.0) -> dict:
    """Peak memory while the loader ``it`` fills its queues (one batch taken first)."""
    me = psutil.Process()
    base = shutil.disk_usage("/dev/shm").used
    next(it)
    peak = {"shm": 0, "worker_rss": 0, "worker_uss": 0, "main_rss": 0}
    last_growth, t0 = time.time(), time.time()
    while time.time() - last_growth < settle and time.time() - t0 < limit:
        shm = shutil.disk_usage("/dev/shm").used - base
        kids = me.children(recursive=True)
        rss = uss = 0
        for k in kids:
            try:
                info = k.memory_full_info()
                rss, uss = rss + info.rss, uss + info.uss
            except psutil.Error:
                pass
        if shm > peak["shm"] + MIB:
            last_growth = time.time()
        peak = {"shm": max(peak["shm"], shm), "worker_rss": max(peak["worker_rss"], rss),
                "worker_uss": max(peak["worker_uss"], uss), "main_rss": max(peak["main_rss"], me.memory_info().rss)}
        time.sleep(0.1)
    return {k: round(v / MIB, 1) for k, v in peak.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import open_clip
    from open_clip.transform import PreprocessCfg, image_transform_v2
    from open_clip_train.data import get_wds_dataset

    from data_tools.build import build
    from mmpretrain.data import host_memory
    from mmpretrain.data.decode import SampleDecoder, split_normalize
    from mmpretrain.data.sources import resolve_sources
    from mmpretrain.data.stream import TrainStream, make_loader

    full = image_transform_v2(PreprocessCfg(size=args.image_size), is_train=True)
    uint8, _ = split_normalize(full, fast=True)  # ours hands over uint8 and normalises on the device
    tokenizer = open_clip.get_tokenizer("ViT-B-32")
    B, W = args.batch_size, args.workers
    batch = host_memory.batch_bytes(B, args.image_size, 77)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "openmoji"
        build("demo:openmoji", data, image_size=256, shard_size=100, image_format="jpg")
        train = data / "train"
        shards = sorted(x.name for x in train.glob("*.tar"))
        sources = resolve_sources(str(train))
        for prefetch in (4, 2):
            plan = trainer_plan(sources, B, W, mode="resampled", num_samples=B * W * 20)
            decoder = SampleDecoder(uint8, embeddings="ignore")
            loader = make_loader(TrainStream(plan, decoder, 0, tokenizer=tokenizer), W, prefetch_factor=prefetch)
            it = iter(loader)
            peak = watch(it)
            expect = host_memory.shm_bytes(batch, W, prefetch) / MIB
            rows.append((f"ours, prefetch_factor={prefetch}", "uint8", peak["shm"], round(expect, 1),
                         peak["worker_rss"], peak["worker_uss"], peak["main_rss"]))
            del it, loader
            time.sleep(2)
        pattern = str(train / f"openmoji-train-{{000000..{len(shards) - 1:06d}}}.tar")
        a = Namespace(train_data=pattern, train_num_samples=B * W * 20, dataset_resampled=True,
                      train_data_upsampling_factors=None, seed=0, batch_size=B, world_size=1, workers=W)
        info = get_wds_dataset(a, full, is_train=True, epoch=0, tokenizer=tokenizer)
        it = iter(info.dataloader)
        peak = watch(it)
        rows.append(("open_clip get_wds_dataset (prefetch 2)", "float32", peak["shm"],
                     round(host_memory.shm_bytes(B * (12 * args.image_size**2 + 8 * 77), W, 2) / MIB, 1), peak["worker_rss"],
                     peak["worker_uss"], peak["main_rss"]))
        del it, info
    header = ("loader", "images", "/dev/shm peak MiB", "formula MiB", "workers RSS MiB", "workers USS MiB",
              "main RSS MiB")
    print(f"batch {B} x {args.image_size} px, {W} workers; one batch = {batch / MIB:.1f} MiB (uint8 + tokens)")
    print(table(rows, header))
    RESULTS.mkdir(exist_ok=True)
    import json
    out = {"command": "python scripts/bench/bench_host_memory.py " + " ".join(sys.argv[1:]),
           "batch_size": B, "image_size": args.image_size, "workers": W, "batch_mib": round(batch / MIB, 1),
           "rows": [dict(zip(header, r)) for r in rows]}
    (RESULTS / "host_memory.json").write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
