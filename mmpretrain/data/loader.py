"""The DataLoader that runs a rank's :class:`~mmpretrain.data.stream.TrainStream` in worker processes."""

from __future__ import annotations

import os
from functools import partial

from torch.utils.data import DataLoader, IterableDataset

from mmpretrain.data.workers import loader_workers


def _lower_priority(nice: int, worker_id: int) -> None:
    os.nice(nice)


def make_loader(stream: IterableDataset, num_workers: int, pin_memory: bool = False, worker_nice: int = 0,
                prefetch_factor: int = 2) -> DataLoader:
    """``worker_nice``: added to the workers' niceness. With the CPU saturated (training on CPU, or
    decoding-bound GPU hosts) the training process's threads then keep their cores and the workers,
    which run ahead by ``prefetch_factor`` batches each, fill the gaps (host memory:
    :mod:`mmpretrain.data.host_memory`)."""
    return DataLoader(
        stream,
        batch_size=None,
        **loader_workers(num_workers, stream, then=partial(_lower_priority, worker_nice) if worker_nice else None),
        persistent_workers=num_workers > 0,
        pin_memory=pin_memory,
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
    )
