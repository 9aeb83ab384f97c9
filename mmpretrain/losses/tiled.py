"""Tiled similarity reductions that never materialise a ``B x B`` matrix (Inf-CL, 2024).

Each is a custom autograd Function over ``chunk x chunk`` tiles of ``s * A B^T``: the forward keeps
only per-row (and per-column) running log-sum-exps or sums, the backward recomputes every tile from
the saved inputs. Peak loss-internal memory is a few tiles plus the per-row statistics.

* :func:`pair_lse`: ``row_i = LSE_j(s a_i.b_j)`` and optionally ``col_j = LSE_i(s a_i.b_j)``
  (both directions of CLIP from one pass over the tiles).
* :func:`softplus_sum`: ``sum_ij softplus(s a_i.b_j + bias)`` (SigLIP's negatives).
* :func:`target_matmul`: ``G V`` with ``G = softmax_r(T_rows T_cols^T / tau)`` built tile by tile
  (the soft-target cross term), gradient into ``V`` only (targets are constants).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _tiles(n: int, chunk: int):
    return [(i, min(i + chunk, n)) for i in range(0, n, chunk)]


class _PairLSE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, scale, chunk: int, want_col: bool):
        n, m = a.shape[0], b.shape[0]
        row = a.new_full((n,), float("-inf"))
        col = a.new_full((m,), float("-inf")) if want_col else a.new_empty(0)
        for i0, i1 in _tiles(n, chunk):
            for j0, j1 in _tiles(m, chunk):
                z = (a[i0:i1] @ b[j0:j1].T).mul_(scale)
                row[i0:i1] = torch.logaddexp(row[i0:i1], torch.logsumexp(z, 1))
                if want_col:
                    col[j0:j1] = torch.logaddexp(col[j0:j1], torch.logsumexp(z, 0))
        ctx.save_for_backward(a, b, scale, row, col)
        ctx.chunk, ctx.want_col = chunk, want_col
        return row, col

    @staticmethod
    def backward(ctx, g_row, g_col):
        a, b, scale, row, col = ctx.saved_tensors
        ga, gb = torch.zeros_like(a), torch.zeros_like(b)
        gs = torch.zeros((), dtype=a.dtype, device=a.device)
        for i0, i1 in _tiles(a.shape[0], ctx.chunk):
            for j0, j1 in _tiles(b.shape[0], ctx.chunk):
                dot = a[i0:i1] @ b[j0:j1].T
                z = dot * scale
                w = torch.exp(z - row[i0:i1, None]).mul_(g_row[i0:i1, None])
                if ctx.want_col and g_col is not None:
                    w += torch.exp(z - col[None, j0:j1]).mul_(g_col[None, j0:j1])
                ga[i0:i1] += (w @ b[j0:j1]).mul_(scale)
                gb[j0:j1] += (w.T @ a[i0:i1]).mul_(scale)
                gs += (w * dot).sum()
        return ga, gb, gs.reshape(scale.shape), None, None


def pair_lse(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, chunk: int, want_col: bool = False):
    """``a (n, D)``, ``b (m, D)``, ``scale`` 0-d. Returns ``row (n,)`` and ``col (m,)`` (empty unless asked)."""
    scale = torch.as_tensor(scale, dtype=a.dtype, device=a.device)
    return _PairLSE.apply(a, b, scale, chunk, want_col)


class _SoftplusSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, scale, bias, chunk: int):
        total = a.new_zeros(())
        for i0, i1 in _tiles(a.shape[0], chunk):
            for j0, j1 in _tiles(b.shape[0], chunk):
                total += F.softplus((a[i0:i1] @ b[j0:j1].T).mul_(scale).add_(bias)).sum()
        ctx.save_for_backward(a, b, scale, bias)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx, g):
        a, b, scale, bias = ctx.saved_tensors
        ga, gb = torch.zeros_like(a), torch.zeros_like(b)
        gs = torch.zeros((), dtype=a.dtype, device=a.device)
        gbias = torch.zeros((), dtype=a.dtype, device=a.device)
        for i0, i1 in _tiles(a.shape[0], ctx.chunk):
            for j0, j1 in _tiles(b.shape[0], ctx.chunk):
                dot = a[i0:i1] @ b[j0:j1].T
                w = torch.sigmoid(dot * scale + bias).mul_(g)
                ga[i0:i1] += (w @ b[j0:j1]).mul_(scale)
                gb[j0:j1] += (w.T @ a[i0:i1]).mul_(scale)
                gs += (w * dot).sum()
                gbias += w.sum()
        return ga, gb, gs.reshape(scale.shape), gbias.reshape(bias.shape), None


def softplus_sum(a: torch.Tensor, b: torch.Tensor, scale, bias, chunk: int) -> torch.Tensor:
    """``sum_ij softplus(scale * a_i.b_j + bias)`` for ``a (n, D)``, ``b (m, D)``."""
    scale = torch.as_tensor(scale, dtype=a.dtype, device=a.device)
    bias = torch.as_tensor(0.0 if bias is None else bias, dtype=a.dtype, device=a.device)
    return _SoftplusSum.apply(a, b, scale, bias, chunk)


@torch.no_grad()
def target_row_lse(t_rows: torch.Tensor, t_cols: torch.Tensor, tau: float, chunk: int) -> torch.Tensor:
    """``LSE_j(t_i.t_j / tau)`` per row, tiled."""
    row = t_rows.new_full((t_rows.shape[0],), float("-inf"))
    for i0, i1 in _tiles(t_rows.shape[0], chunk):
        for j0, j1 in _tiles(t_cols.shape[0], chunk):
            row[i0:i1] = torch.logaddexp(row[i0:i1], torch.logsumexp(t_rows[i0:i1] @ t_cols[j0:j1].T / tau, 1))
    return row


class _TargetMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, v, t_rows, t_cols, row_lse, tau: float, chunk: int):
        out = v.new_zeros((t_rows.shape[0], v.shape[1]))
        for i0, i1 in _tiles(t_rows.shape[0], chunk):
            for j0, j1 in _tiles(t_cols.shape[0], chunk):
                g = torch.exp(t_rows[i0:i1] @ t_cols[j0:j1].T / tau - row_lse[i0:i1, None]).to(v.dtype)
                out[i0:i1] += g @ v[j0:j1]
        ctx.save_for_backward(t_rows, t_cols, row_lse)
        ctx.tau, ctx.chunk, ctx.v_dtype = tau, chunk, v.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        t_rows, t_cols, row_lse = ctx.saved_tensors
        gv = grad_out.new_zeros((t_cols.shape[0], grad_out.shape[1]))
        for i0, i1 in _tiles(t_rows.shape[0], ctx.chunk):
            for j0, j1 in _tiles(t_cols.shape[0], ctx.chunk):
                g = torch.exp(t_rows[i0:i1] @ t_cols[j0:j1].T / ctx.tau - row_lse[i0:i1, None]).to(ctx.v_dtype)
                gv[j0:j1] += g.T @ grad_out[i0:i1]
        return gv, None, None, None, None, None


def target_matmul(v: torch.Tensor, t_rows: torch.Tensor, t_cols: torch.Tensor, tau: float, chunk: int,
                  row_lse: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax_r(t_rows t_cols^T / tau) @ v`` for ``v (m, D)``, ``t_rows (n, E)``, ``t_cols (m, E)``
    (targets detached); the gradient flows into ``v``."""
    if row_lse is None:
        row_lse = target_row_lse(t_rows, t_cols, tau, chunk)
    return _TargetMatmul.apply(v, t_rows.detach(), t_cols.detach(), row_lse, tau, chunk)
