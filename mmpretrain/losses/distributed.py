"""Collectives for objectives. Rank and world size are always explicit (never guessed)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn as dist_nn


def gather_with_grad(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """All-gather ``x (B, D)`` from every rank into ``(world_size * B, D)``, rank-major, keeping the
    autograd graph: the backward pass sums each slice's gradient over ranks (as open_clip's
    ``gather_with_grad``)."""
    if world_size == 1:
        return x
    return torch.cat(dist_nn.all_gather(x), dim=0)


def gather_no_grad(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """All-gather a tensor that needs no gradient (targets, labels)."""
    if world_size == 1:
        return x
    out = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(out, x.contiguous())
    return torch.cat(out, dim=0)


def logsumexp_ranks(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """``log sum_r exp(x_r)`` elementwise over the ranks' ``x`` (no gradient): two all-reduces of ``x``'s
    size (the max, then the shifted sum), never a ``world x len(x)`` gather."""
    if world_size == 1:
        return x
    m = x.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    e = (x - m).exp()
    dist.all_reduce(e)
    return m + e.log()


def scale_grad(x: torch.Tensor, factor: float) -> torch.Tensor:
    """Same value as ``x``; the gradient flowing back through it is multiplied by ``factor``."""
    if factor == 1:
        return x
    return x + (factor - 1) * (x - x.detach())
