"""Tiled similarity reductions that never materialise a ``B x B`` matrix (Inf-CL, 2024).

Each is a custom autograd Function over ``chunk x chunk`` tiles of ``s * A B^T``: the forward keeps
only per-row (and per-column) running log-sum-exps or sums, the backward recomputes every tile from
the saved inputs. Peak loss-internal memory is a few tiles plus the per-row statistics.

* :func:`pair_ce`: per-row InfoNCE ``LSE_j(s a_i.b_j) - s a_i.b_{i+offset}`` and optionally per
  column (both directions of CLIP from one pass over the tiles); :func:`pair_lse` without positives.
* :func:`softplus_sum`: ``sum_ij softplus(s a_i.b_j + bias)`` minus the positives' logits (SigLIP).
* :func:`target_matmul`: ``G V`` with ``G = softmax_r(T_rows T_cols^T / tau + c)`` built tile by tile
  (the soft-target cross term; ``c`` Sinkhorn's column scalings for ``resa``), gradient into ``V`` only
  (targets are constants).

Mixed precision: the forward keeps running log-sum-exps that the backward's recomputed tiles must
match exactly (``exp(z - LSE)`` has to sum to 1), so both run in at least fp32 with autocast off,
whatever the caller's autocast (bf16 tiles in the forward against fp32 tiles in the backward gave
a 16 % gradient error). Inputs in bf16/fp16 are cast up; their gradients come back in their dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# a column bias that leaves a column out: exp(-1e4 + s * dot) is exactly 0 in fp32 and fp64 for any
# |s * dot| <= 100 (the clamped scale), so it adds nothing to a log-sum-exp, a softplus or a gradient;
# finite, so no inf - inf appears where a column's own statistics are formed
MASKED = -1e4


def _full(*tensors):
    """Each tensor in at least fp32 (a float64 input stays float64)."""
    return tuple(t.to(torch.promote_types(t.dtype, torch.float32)) for t in tensors)


def _no_autocast(t: torch.Tensor):
    return torch.autocast(t.device.type, enabled=False)


def _tiles(n: int, chunk: int):
    return [(i, min(i + chunk, n)) for i in range(0, n, chunk)]


def _diag(n: int, m: int, offset: int):
    """Row indices ``i`` whose positive column ``i + offset`` exists in an ``(n, m)`` block."""
    lo, hi = max(0, -offset), min(n, m - offset)
    return lo, hi


def _rowdot(a: torch.Tensor, b: torch.Tensor, chunk: int) -> torch.Tensor:
    """``(a * b).sum(1)`` without an ``(n, D)`` temporary."""
    out = a.new_empty(a.shape[0])
    for i0, i1 in _tiles(a.shape[0], chunk):
        out[i0:i1] = (a[i0:i1] * b[i0:i1]).sum(1)
    return out


class _PairCE(torch.autograd.Function):
    """Per-row cross-entropy with the positive at column ``i + offset``:
    ``row_i = LSE_j(s a_i.b_j) - s a_i.b_{i+offset}``; with ``want_col`` also per column
    ``col_j = LSE_i(s a_i.b_j) - s a_{j-offset}.b_j``. The positives are folded into the same
    backward, so the only buffers besides one tile are the gradients themselves."""

    @staticmethod
    def forward(ctx, a, b, scale, chunk: int, offset: int, want_col: bool, col_bias=None):
        n, m = a.shape[0], b.shape[0]
        row = a.new_full((n,), float("-inf"))
        col = a.new_full((m,), float("-inf")) if want_col else a.new_empty(0)
        for i0, i1 in _tiles(n, chunk):
            for j0, j1 in _tiles(m, chunk):
                z = (a[i0:i1] @ b[j0:j1].T).mul_(scale)
                if col_bias is not None:
                    z += col_bias[None, j0:j1]
                row[i0:i1] = torch.logaddexp(row[i0:i1], torch.logsumexp(z, 1))
                if want_col:
                    col[j0:j1] = torch.logaddexp(col[j0:j1], torch.logsumexp(z, 0))
        lo, hi = _diag(n, m, offset)
        pos = _rowdot(a[lo:hi], b[lo + offset:hi + offset], chunk).mul_(scale)
        row[lo:hi] -= pos
        if want_col:
            col[lo + offset:hi + offset] -= pos
        ctx.save_for_backward(a, b, scale, row + 0, col + 0, pos, col_bias)
        ctx.chunk, ctx.offset, ctx.want_col = chunk, offset, want_col
        return row, col

    @staticmethod
    def backward(ctx, g_row, g_col):
        with _no_autocast(ctx.saved_tensors[0]):
            return _PairCE._backward(ctx, g_row, g_col)

    @staticmethod
    def _backward(ctx, g_row, g_col):
        a, b, scale, row, col, pos, col_bias = ctx.saved_tensors
        n, m, off = a.shape[0], b.shape[0], ctx.offset
        lo, hi = _diag(n, m, off)
        # the saved statistics hold CE = LSE - pos; the softmax needs the LSE back
        row_lse = row.clone()
        row_lse[lo:hi] += pos
        use_col = ctx.want_col and g_col is not None
        if use_col:
            col_lse = col.clone()
            col_lse[lo + off:hi + off] += pos
        # gradients accumulated without the scale, multiplied by it once at the end: a tensor
        # multiply, where addmm's alpha would need the scale as a host number (a device sync)
        ga, gb = torch.zeros_like(a), torch.zeros_like(b)
        gs = torch.zeros((), dtype=a.dtype, device=a.device)
        for i0, i1 in _tiles(n, ctx.chunk):
            for j0, j1 in _tiles(m, ctx.chunk):
                dot = a[i0:i1] @ b[j0:j1].T
                z = dot * scale
                if col_bias is not None:
                    z += col_bias[None, j0:j1]
                w = torch.exp(z - row_lse[i0:i1, None]).mul_(g_row[i0:i1, None])
                if use_col:
                    w += torch.exp(z - col_lse[None, j0:j1]).mul_(g_col[None, j0:j1])
                ga[i0:i1].addmm_(w, b[j0:j1])
                gb[j0:j1].addmm_(w.T, a[i0:i1])
                gs += (w * dot).sum()
        # positives: d(-s a_i.b_{i+off}) for the rows, and for the columns
        gpos = g_row[lo:hi].clone()
        if use_col:
            gpos += g_col[lo + off:hi + off]
        ga[lo:hi].addcmul_(gpos[:, None], b[lo + off:hi + off], value=-1)
        gb[lo + off:hi + off].addcmul_(gpos[:, None], a[lo:hi], value=-1)
        gs -= (gpos * pos).sum() / scale
        return ga.mul_(scale), gb.mul_(scale), gs.reshape(scale.shape), None, None, None, None


def pair_ce(a: torch.Tensor, b: torch.Tensor, scale, chunk: int, offset: int = 0, want_col: bool = False,
            col_bias: torch.Tensor | None = None):
    """Per-row (and per-column) InfoNCE terms of ``s a b^T`` with positives on the ``offset``
    diagonal, for ``a (n, D)``, ``b (m, D)``: ``row (n,)``, ``col (m,)`` (empty unless asked).
    ``col_bias (m,)``: a constant added to every logit of a column (:data:`MASKED` leaves a column out;
    a positive's column must not be masked)."""
    with _no_autocast(a):
        a, b = _full(a, b)
        scale = torch.as_tensor(scale, device=a.device).to(a.dtype)
        if col_bias is not None:
            col_bias = col_bias.detach().to(a.dtype)
        return _PairCE.apply(a, b, scale, chunk, offset, want_col, col_bias)


def pair_lse(a: torch.Tensor, b: torch.Tensor, scale, chunk: int):
    """``LSE_j(s a_i.b_j)`` per row (no positive subtracted): ``pair_ce`` with the diagonal off the block."""
    return pair_ce(a, b, scale, chunk, offset=b.shape[0])[0]


class _SoftplusSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, scale, bias, chunk: int, offset: int | None, col_bias=None):
        total = a.new_zeros(())
        for i0, i1 in _tiles(a.shape[0], chunk):
            for j0, j1 in _tiles(b.shape[0], chunk):
                z = (a[i0:i1] @ b[j0:j1].T).mul_(scale).add_(bias)
                if col_bias is not None:
                    z += col_bias[None, j0:j1]
                total += F.softplus(z).sum()
        if offset is not None:
            lo, hi = _diag(a.shape[0], b.shape[0], offset)
            total -= (_rowdot(a[lo:hi], b[lo + offset:hi + offset], chunk) * scale + bias).sum()
        ctx.save_for_backward(a, b, scale, bias, col_bias)
        ctx.chunk, ctx.offset = chunk, offset
        return total

    @staticmethod
    def backward(ctx, g):
        with _no_autocast(ctx.saved_tensors[0]):
            return _SoftplusSum._backward(ctx, g)

    @staticmethod
    def _backward(ctx, g):
        a, b, scale, bias, col_bias = ctx.saved_tensors
        # as in _PairCE: the scale (and the incoming gradient) enter as tensors, never host numbers
        ga, gb = torch.zeros_like(a), torch.zeros_like(b)
        gs = torch.zeros((), dtype=a.dtype, device=a.device)
        gbias = torch.zeros((), dtype=a.dtype, device=a.device)
        for i0, i1 in _tiles(a.shape[0], ctx.chunk):
            for j0, j1 in _tiles(b.shape[0], ctx.chunk):
                dot = a[i0:i1] @ b[j0:j1].T
                z = dot * scale + bias
                if col_bias is not None:
                    z += col_bias[None, j0:j1]
                w = torch.sigmoid(z).mul_(g)
                ga[i0:i1].addmm_(w, b[j0:j1])
                gb[j0:j1].addmm_(w.T, a[i0:i1])
                gs += (w * dot).sum()
                gbias += w.sum()
        if ctx.offset is not None:
            off = ctx.offset
            lo, hi = _diag(a.shape[0], b.shape[0], off)
            ga[lo:hi].sub_(b[lo + off:hi + off] * g)
            gb[lo + off:hi + off].sub_(a[lo:hi] * g)
            gs -= g * _rowdot(a[lo:hi], b[lo + off:hi + off], ctx.chunk).sum()
            gbias -= g * (hi - lo)
        return ga.mul_(scale), gb.mul_(scale), gs.reshape(scale.shape), gbias.reshape(bias.shape), None, None, None


def softplus_sum(a: torch.Tensor, b: torch.Tensor, scale, bias, chunk: int, offset: int | None = None,
                 col_bias: torch.Tensor | None = None):
    """``sum_ij softplus(s a_i.b_j + bias)`` for ``a (n, D)``, ``b (m, D)``, minus the logits
    ``s a_i.b_{i+offset} + bias`` of the positives when ``offset`` is given (SigLIP:
    ``-log sigmoid(l) = softplus(l) - l``). ``col_bias (m,)``: a constant added to every logit of a
    column (:data:`MASKED` leaves it out: softplus and its gradient are exactly 0 there)."""
    with _no_autocast(a):
        a, b = _full(a, b)
        scale = torch.as_tensor(scale, device=a.device).to(a.dtype)
        bias = torch.as_tensor(0.0 if bias is None else bias, device=a.device).to(a.dtype)
        if col_bias is not None:
            col_bias = col_bias.detach().to(a.dtype)
        return _SoftplusSum.apply(a, b, scale, bias, chunk, offset, col_bias)


class _TargetMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, v, t_rows, t_cols, tau: float, chunk: int, col_bias=None):
        # one pass with an online softmax (running max and sum, rescaled accumulator), so the
        # normaliser needs no separate pass over the target tiles
        n = t_rows.shape[0]
        out = v.new_zeros((n, v.shape[1]))
        lse = t_rows.new_empty(n)
        for i0, i1 in _tiles(n, chunk):
            m = t_rows.new_full((i1 - i0,), float("-inf"))
            norm = t_rows.new_zeros(i1 - i0)
            acc = out[i0:i1]
            for j0, j1 in _tiles(t_cols.shape[0], chunk):
                sim = t_rows[i0:i1] @ t_cols[j0:j1].T / tau
                if col_bias is not None:
                    sim += col_bias[None, j0:j1]
                m_new = torch.maximum(m, sim.max(1).values)
                alpha = torch.exp(m - m_new)
                p = torch.exp(sim - m_new[:, None])
                norm = norm * alpha + p.sum(1)
                acc.mul_(alpha[:, None].to(v.dtype)).add_(p.to(v.dtype) @ v[j0:j1])
                m = m_new
            acc.div_(norm[:, None].to(v.dtype))
            lse[i0:i1] = m + torch.log(norm)
        ctx.save_for_backward(t_rows, t_cols, lse, col_bias)
        ctx.tau, ctx.chunk, ctx.v_dtype = tau, chunk, v.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        with _no_autocast(grad_out):
            return _TargetMatmul._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        t_rows, t_cols, row_lse, col_bias = ctx.saved_tensors
        gv = grad_out.new_zeros((t_cols.shape[0], grad_out.shape[1]))
        for i0, i1 in _tiles(t_rows.shape[0], ctx.chunk):
            for j0, j1 in _tiles(t_cols.shape[0], ctx.chunk):
                sim = t_rows[i0:i1] @ t_cols[j0:j1].T / ctx.tau
                if col_bias is not None:
                    sim += col_bias[None, j0:j1]
                g = torch.exp(sim - row_lse[i0:i1, None]).to(ctx.v_dtype)
                gv[j0:j1] += g.T @ grad_out[i0:i1]
        return gv, None, None, None, None, None


def target_matmul(v: torch.Tensor, t_rows: torch.Tensor, t_cols: torch.Tensor, tau: float, chunk: int,
                  col_bias: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax_r(t_rows t_cols^T / tau + col_bias) @ v`` for ``v (m, D)``, ``t_rows (n, E)``, ``t_cols
    (m, E)``, ``col_bias (m,)`` (targets detached; Sinkhorn's column scalings in ``resa``); the gradient
    flows into ``v``."""
    with _no_autocast(v):
        v, t_rows, t_cols = _full(v, t_rows.detach(), t_cols.detach())
        if col_bias is not None:
            col_bias = col_bias.detach().to(t_rows.dtype)
        return _TargetMatmul.apply(v, t_rows, t_cols, tau, chunk, col_bias)


def soft_pair_ce(x: torch.Tensor, y: torch.Tensor, all_x: torch.Tensor, all_y: torch.Tensor, t_rows: torch.Tensor,
                 t_cols: torch.Tensor, tau: float, scale, chunk: int, world_size: int,
                 col_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The symmetric soft-target cross-entropy of this rank's rows, ``G = softmax_r(t_rows t_cols^T / tau +
    col_bias)``: ``1/2 [mean_i (LSE_j(s x_i.y_j) - s x_i.(G Y)_i) + mean_i (LSE_j(s y_i.x_j) - s y_i.(G X)_i)]``
    (rows of ``G`` sum to 1, so the LSE enters once), LSEs from tiles and ``G [Y | X]`` from one pass over the
    target tiles (``soft_target``'s frozen-text ``G``, ``resa``'s Sinkhorn assignment)."""
    scale = torch.as_tensor(scale, device=x.device)
    if world_size == 1:
        row_i, row_t = pair_ce(x, y, scale, chunk, offset=y.shape[0], want_col=True)
    else:
        row_i = pair_lse(x, all_y, scale, chunk)
        row_t = pair_lse(y, all_x, scale, chunk)
    gy, gx = target_matmul(torch.cat([all_y, all_x], 1), t_rows, t_cols, tau, chunk,
                           col_bias=col_bias).split(x.shape[1], dim=1)
    return 0.5 * ((row_i - scale * (x * gy).sum(1)).mean() + (row_t - scale * (y * gx).sum(1)).mean())
