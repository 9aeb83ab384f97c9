"""The batched, rank-split image pass every task shares.

Sample ``i`` of a dataset belongs to rank ``i % world_size`` (the ranks are told, in
:class:`EvalContext`); within a rank DataLoader workers split that share again, decode and
preprocess in parallel and batch inside the worker. Each rank encodes only its own samples; one
``all_gather_object`` per pass (over the default process group) brings every rank the whole set, put
back in dataset order by the sample index, so nothing is counted twice or lost and metrics are
identical on every rank. Every rank makes the same collective calls whatever its share (even an
empty one), so none is left waiting."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from tqdm.auto import tqdm

from mmpretrain.data.workers import loader_workers


@dataclass(frozen=True)
class EvalContext:
    """How a task runs: batching, device, workers, retrieval ``k``s, and which rank of how many this is."""

    batch_size: int = 256
    device: str = "cpu"
    num_workers: int = 0
    recall_k: tuple[int, ...] = (1, 5, 10)
    rank: int = 0
    world_size: int = 1
    skipped: Counter = field(default_factory=Counter, compare=False)  # this rank's skipped samples, by reason
    # image features already extracted in this run (one model): the probe tasks share a dataset's pass
    features: dict | None = field(default=None, compare=False)
    # captioning's generate() options: num_beams, max_len, min_len (mmpretrain.eval.captioning's defaults)
    generation: dict | None = field(default=None, compare=False)


def gather(obj: Any, world_size: int) -> list[Any]:
    """Every rank's ``obj`` (CPU tensors, lists), in rank order, on every rank."""
    if world_size == 1:
        return [obj]
    out: list[Any] = [None] * world_size
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
            if s.image is None:
                yield i, None, s.skip or "undecodable_image", None  # counted by batches(), not evaluated
                continue
            yield i, self.preprocess(s.image), s.captions, s.label


def _collate(rows):
    bad = Counter(r[2] for r in rows if r[1] is None)
    rows = [r for r in rows if r[1] is not None]
    if not rows:
        return torch.empty(0, dtype=torch.long), None, [], [], bad
    idx, images, captions, labels = zip(*rows)
    return torch.tensor(idx), torch.stack(images), list(captions), list(labels), bad


def batches(ds, preprocess, ctx: EvalContext, labelled_only: bool = False,
            desc: str = "") -> Iterator[tuple[torch.Tensor, torch.Tensor, list[list[str]], list[int | None]]]:
    """``(indices, images, captions, labels)`` batches of this rank's share, with a progress bar on rank 0.
    Undecodable images are left out and counted in ``ctx.skipped``."""
    share = _Share(ds, preprocess, ctx.rank, ctx.world_size, labelled_only)
    loader = DataLoader(share, batch_size=ctx.batch_size, collate_fn=_collate,
                        **loader_workers(ctx.num_workers, share, _collate))
    n = None if labelled_only else ds.num_samples()
    total = math.ceil(n / ctx.world_size) if n is not None else None
    with tqdm(total=total, desc=desc or ds.name, unit="img", disable=ctx.rank != 0, leave=False) as bar:
        for *b, bad in loader:
            ctx.skipped.update(bad)
            bar.update(len(b[0]) + sum(bad.values()))
            if len(b[0]):
                yield tuple(b)


def gather_in_order(parts: dict[str, Any], index: torch.Tensor, world_size: int) -> tuple[dict[str, Any], torch.Tensor]:
    """Gather per-sample ``parts`` (tensors with a leading sample axis, or lists) from every rank and
    sort them by the global sample ``index``."""
    everything = gather({"index": index, **parts}, world_size)
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


def split_map(fn: Callable[[list], torch.Tensor], items: list, ctx: EvalContext) -> torch.Tensor:
    """``fn`` over ``items`` split across ranks (item ``j`` on rank ``j % world``), gathered back in
    order: ``(len(items), ...)``."""
    mine = list(range(ctx.rank, len(items), ctx.world_size))
    local = fn([items[j] for j in mine]) if mine else torch.empty(0)
    out, _ = gather_in_order({"x": local.float().cpu()}, torch.tensor(mine, dtype=torch.long), ctx.world_size)
    return out["x"]


def cat_or_empty(parts: list[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.empty(0, dtype=dtype)
