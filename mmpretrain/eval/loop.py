"""The batched, rank-split image pass every task shares.

Under ``accelerate launch`` (or any initialised ``torch.distributed`` group) sample ``i`` of a dataset
belongs to rank ``i % world``; within a rank DataLoader workers split that share again, decode and
preprocess in parallel and batch inside the worker. Each rank encodes only its own samples; one
``all_gather_object`` per pass brings every rank the whole set, put back in dataset order by the
sample index, so nothing is counted twice or lost and metrics are identical on every rank. Every rank
makes the same collective calls whatever its share (even an empty one), so none is left waiting."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info


def rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (CPU tensors, lists), in rank order, on every rank."""
    _, world = rank_world()
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


class _Share(IterableDataset):
    """``(index, image tensor, captions, label)`` for this rank's and this worker's samples."""

    def __init__(self, ds, preprocess, rank: int, world: int, labelled_only: bool):
        self.ds, self.preprocess, self.rank, self.world = ds, preprocess, rank, world
        self.labelled_only = labelled_only

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        for i, s in self.ds.indexed(self.rank, self.world, part=wid, parts=nw):
            if self.labelled_only and s.label is None:
                continue
            yield i, self.preprocess(s.image), s.captions, s.label


def _collate(rows):
    idx, images, captions, labels = zip(*rows)
    return torch.tensor(idx), torch.stack(images), list(captions), list(labels)


def batches(ds, preprocess, batch_size: int, num_workers: int = 0, labelled_only: bool = False,
            desc: str = "") -> Iterator[tuple[torch.Tensor, torch.Tensor, list[list[str]], list[int | None]]]:
    """``(indices, images, captions, labels)`` batches of this rank's share, with a progress bar on rank 0."""
    from tqdm.auto import tqdm

    rank, world = rank_world()
    # fork (Linux's default) even inside a process that was itself spawned, where workers would
    # otherwise re-import everything (~9 s each here)
    ctx = "fork" if num_workers and sys.platform == "linux" else None
    loader = DataLoader(_Share(ds, preprocess, rank, world, labelled_only), batch_size=batch_size,
                        num_workers=num_workers, collate_fn=_collate, multiprocessing_context=ctx)
    n = None if labelled_only else ds.num_samples()
    total = math.ceil(n / world) if n is not None else None
    with tqdm(total=total, desc=desc or ds.name, unit="img", disable=rank != 0, leave=False) as bar:
        for b in loader:
            yield b
            bar.update(len(b[0]))


def gather_in_order(parts: dict[str, Any], index: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
    """Gather per-sample ``parts`` (tensors with a leading sample axis, or lists) from every rank and
    sort them by the global sample ``index``."""
    everything = gather({"index": index, **parts})
    index = torch.cat([e["index"] for e in everything])
    order = torch.argsort(index)
    out: dict[str, Any] = {}
    for k in parts:
        vals = [e[k] for e in everything]
        if isinstance(vals[0], torch.Tensor) or vals[0] is None:
            present = [v for v in vals if v is not None and v.numel()]
            out[k] = torch.cat(present)[order] if present else None
        else:
            flat = [x for v in vals for x in v]
            out[k] = [flat[i] for i in order.tolist()]
    return out, index[order]


def split_map(fn: Callable[[list], torch.Tensor], items: list) -> torch.Tensor:
    """``fn`` over ``items`` split across ranks (item ``j`` on rank ``j % world``), gathered back in
    order: ``(len(items), ...)``."""
    rank, world = rank_world()
    mine = list(range(rank, len(items), world))
    local = fn([items[j] for j in mine]) if mine else torch.empty(0)
    out, _ = gather_in_order({"x": local.float().cpu()}, torch.tensor(mine, dtype=torch.long))
    return out["x"]
