"""The arithmetic of region weighting (:mod:`mmpretrain.losses.regions`) that runs on the device without
reading it on the host: the Hedge update, the masked per-region InfoNCE in row tiles, and the purity
diagnostic; static shapes throughout (masks, not boolean indexing)."""

from __future__ import annotations

import math

import torch

__all__ = ["TILE_ELEMENTS", "hedge_update", "masked_clip_regions", "one_hot", "purity", "tile_rows"]

# The masked pass runs in row tiles of at most this many logits (each tile's rows against the whole
# gathered batch, recomputed in the backward when there is more than one tile): 2^24 fp32 logits =
# 64 MiB a tile, so a gathered batch of 65,536 never builds its 16 GiB B x B matrix.
TILE_ELEMENTS = 2**24


def tile_rows(n: int) -> int:
    return max(1, min(n, TILE_ELEMENTS // max(n, 1)))


def hedge_update(log_q: torch.Tensor, losses: torch.Tensor, present: torch.Tensor, eta: float) -> torch.Tensor:
    """``q_r <- q_r exp(eta L_r) / Z`` over the present regions, keeping their total mass; absent
    regions keep their weight. In log space; returns normalised log-weights. Masks, not indexing: no
    data-dependent shapes (a host sync on a GPU)."""
    mass = torch.logsumexp(log_q.masked_fill(~present, -math.inf), 0)
    upd = (log_q + eta * losses).masked_fill(~present, -math.inf)
    new = torch.where(present, upd - torch.logsumexp(upd, 0) + mass, log_q)
    return new - torch.logsumexp(new, 0)


def masked_clip_regions(x: torch.Tensor, y: torch.Tensor, scale, assign: torch.Tensor, sizes: torch.Tensor,
                        rows: int | None = None) -> torch.Tensor:
    """Per region ``r``, symmetric InfoNCE over the region's own rows and columns of the logits
    ``scale * x @ y.T`` (row ``i``'s normaliser runs over the ``j`` with ``assign[j] == assign[i]``):
    ``(m,)``, 0 for empty regions. In tiles of ``rows`` rows (default :func:`tile_rows`): each tile's
    image->text rows and text->image columns against the whole batch, recomputed in the backward when
    there is more than one tile, so no ``N x N`` matrix exists. Per-region sums by a one-hot product
    (deterministic, no atomics)."""
    n = x.shape[0]
    rows = rows or tile_rows(n)
    if rows >= n:
        ce = _tile_ce(x, y, scale, assign, 0, n)
    else:
        from torch.utils.checkpoint import checkpoint

        ce = torch.cat([checkpoint(_tile_ce, x, y, scale, assign, a, min(a + rows, n), use_reentrant=False)
                        for a in range(0, n, rows)])
    total = one_hot(assign, sizes.shape[0]).to(ce.dtype).T @ ce
    return total / (2 * sizes.clamp_min(1).to(ce.dtype))


def one_hot(assign: torch.Tensor, m: int) -> torch.Tensor:
    """``(N, m)`` bool by comparison: F.one_hot checks its input's range on the host (a sync on a GPU)."""
    return assign[:, None] == torch.arange(m, device=assign.device)


def _tile_ce(x, y, scale, assign, a: int, b: int) -> torch.Tensor:
    """Rows ``a:b``: image->text cross-entropy over the row's region + text->image over the column's."""
    same = assign[a:b, None] == assign[None, :]
    pos = scale * (x[a:b] * y[a:b]).sum(1)
    row = (scale * x[a:b] @ y.T).masked_fill(~same, float("-inf")).logsumexp(1)
    col = (scale * y[a:b] @ x.T).masked_fill(~same, float("-inf")).logsumexp(1)
    return (row - pos) + (col - pos)


def purity(assign: torch.Tensor, labels: torch.Tensor, m: int) -> torch.Tensor:
    """Share of the labelled samples that carry their region's most frequent label (nan: no labels).
    Static shapes throughout (nothing read on the host): the (region, label) pairs sorted, each run's
    length counted into a table of N slots, and each region's longest run taken."""
    n = assign.shape[0]
    known = labels >= 0
    key, order = torch.sort(assign.long() * 2**32 + labels.long().clamp_min(0), stable=True)
    run = torch.cat([key.new_zeros(1), (key[1:] != key[:-1]).long()]).cumsum(0)  # run id of each sorted pair
    counts = torch.zeros(n, dtype=torch.float64, device=assign.device).scatter_add_(
        0, run, known[order].double())
    region = torch.zeros(n, dtype=torch.long, device=assign.device).scatter_(0, run, key // 2**32)
    best = torch.zeros(m, dtype=torch.float64, device=assign.device).scatter_reduce_(
        0, region, counts, "amax", include_self=True)
    total = known.sum()
    return torch.where(total > 0, best.sum() / total.clamp_min(1), torch.nan).float()
