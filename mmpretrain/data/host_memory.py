"""What the loader holds in host memory, and the start-of-run check that ``/dev/shm`` can hold it.

A DataLoader worker hands each batch to the training process through shared memory (``/dev/shm``):
with ``W`` workers and ``data.prefetch_factor`` ``p``, up to ``W * p`` batches wait there, plus the one
being trained on and the one the pin-memory thread copies. Every rank of a node does the same, so a node
needs ``local ranks * (W * p + 2) * batch bytes``, with a batch of ``B`` samples at ``H x W`` pixels
``B * (3 * H * W + 8 * context + 4 * embedding dim)`` bytes (uint8 images, int64 tokens, fp32 stored
caption embeddings). Docker's default ``/dev/shm`` is 64 MB; short of it, a worker dies of a bus error
mid-run. Pinned copies (on CUDA) come from torch's caching host allocator, which rounds each up to a
power of two: above :data:`PIN_MAX` a batch is not pinned (the copy to the device is then synchronous,
~1 ms per 100 MB on PCIe 4, against holding twice the bytes locked)."""

from __future__ import annotations

import os
import shutil

PIN_MAX = 256 * 2**20
SHM = "/dev/shm"


def batch_bytes(batch_size: int, image_size: int | tuple[int, int], context: int = 0, emb_dim: int = 0) -> int:
    h, w = (image_size, image_size) if isinstance(image_size, int) else image_size
    return batch_size * (3 * h * w + 8 * context + 4 * emb_dim)


def shm_bytes(batch: int, workers: int, prefetch_factor: int, local_ranks: int = 1) -> int:
    """The most the loaders of ``local_ranks`` ranks on one node hold in shared memory at once."""
    return 0 if workers == 0 else local_ranks * (workers * prefetch_factor + 2) * batch


def local_ranks() -> int:
    """Ranks on this node (torchrun's and accelerate launch's ``LOCAL_WORLD_SIZE``; 1 without it)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))


def check_shm(need: int, batch: int, workers: int, prefetch_factor: int, ranks: int, path: str | None = None) -> None:
    """Raise ``ValueError`` naming the fixes when ``path`` (``/dev/shm``) has less free space than ``need``."""
    path = path or SHM
    if need == 0 or not os.path.isdir(path):
        return
    free = shutil.disk_usage(path).free
    if free >= need:
        return
    gib = 2**30
    raise ValueError(
        f"{path} has {free / gib:.2f} GiB free, the loader needs up to {need / gib:.2f} GiB there ({ranks} rank(s) "
        f"x ({workers} workers x data.prefetch_factor={prefetch_factor} + 2) batches of {batch / 2**20:.0f} MiB): "
        f"in Docker, run with --shm-size={max(1, -(-need * 5 // 4 // gib))}g (or --ipc=host); or lower "
        "data.prefetch_factor, data.num_workers or data.batch_size")


def pin(batch: int) -> bool:
    """Whether a batch of this many bytes is pinned (on CUDA)."""
    return batch <= PIN_MAX
