"""Self-assigned similarity targets: ReSA (Weng et al., "Clustering Properties of Self-Supervised
Learning", ICML 2025; code winci-ai/resa), in the image-text form.

ReSA turns the encoder's own outputs into targets: with ``H (N, P)`` the L2-normalised encodings of the
gathered batch before the projector (from the current weights, or from the momentum copy: ReSA's
better variant, here the ``train.ema`` average), ``A = sinkhorn(H H^T / eps)``: ReSA's Sinkhorn-Knopp
(SwAV's), ``eps = 0.05``, three iterations, no gradient, which leaves every row of ``A`` summing to 1
(the columns close to 1). ReSA's unimodal loss is ``CE(E_1 E_2m^T / t, A)`` between two views'
embeddings; here the caption plays the second view, in both directions:

    L = -1/(2N) sum_ij A_ij [log softmax_j(s x_i.y_j) + log softmax_j(s y_i.x_j)]

with ``s`` the model's logit scale (or ``1 / temperature``). ``A = I`` would be CLIP; X-CLR's frozen-text
``G`` is the same loss with ``G`` in place of ``A`` (``soft_target``): this is that objective with targets
found by the image tower itself, no frozen model.

The Sinkhorn iterations in log space: ``A = exp(S + a_i + c_j)`` with ``S = H H^T / eps``; a column step
``c_j = -LSE_i(S_ij + a_i) - log N``, a row step ``a_i = -LSE_j(S_ij + c_j) - log N``; after the last
column step the final row normalisation makes ``A = softmax_r(S + c)``. Every step is a pass over tiles
of ``S`` keeping ``O(N)`` state (each rank its own rows; the column sums are reduced across ranks), and
``A [Y | X]`` is built tile by tile with an online softmax (``target_matmul`` with the column offsets
``c``): no ``N x N`` matrix with ``chunk_size``. Targets in at least fp32 under autocast.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F

from mmpretrain.losses.base import Objective
from mmpretrain.losses.distributed import gather_no_grad, gather_with_grad, logsumexp_ranks
from mmpretrain.losses.tiled import soft_pair_ce


def _tiles(n: int, chunk: int | None):
    chunk = chunk or n
    return [(i, min(i + chunk, n)) for i in range(0, n, chunk)]


@torch.no_grad()
def sinkhorn_columns(h_local: torch.Tensor, h_all: torch.Tensor, eps: float, iterations: int,
                     chunk: int | None = None, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(c (N,), lse (b,))``: the column log-scalings with ``A_local = softmax_r(h_local h_all^T / eps + c)``,
    ReSA's Sinkhorn-Knopp over the gathered batch (``h_all``, every rank's rows; ``h_local`` this rank's),
    and the rows' log-normaliser of that softmax."""
    n = h_all.shape[0]
    a = h_local.new_zeros(h_local.shape[0])
    c = h_local.new_zeros(n)
    log_n = math.log(n)
    for _ in range(iterations):
        col = h_local.new_full((n,), float("-inf"))
        for i0, i1 in _tiles(h_local.shape[0], chunk):
            for j0, j1 in _tiles(n, chunk):
                z = h_local[i0:i1] @ h_all[j0:j1].T / eps + a[i0:i1, None]
                col[j0:j1] = torch.logaddexp(col[j0:j1], torch.logsumexp(z, 0))
        col = logsumexp_ranks(col, world_size)  # every rank's rows: the column sums over the whole batch
        c = -col - log_n
        row = h_local.new_full((h_local.shape[0],), float("-inf"))
        for i0, i1 in _tiles(h_local.shape[0], chunk):
            for j0, j1 in _tiles(n, chunk):
                z = h_local[i0:i1] @ h_all[j0:j1].T / eps + c[None, j0:j1]
                row[i0:i1] = torch.logaddexp(row[i0:i1], torch.logsumexp(z, 1))
        a = -row - log_n  # after the last column step: the softmax's normaliser (the final row step)
    return c, row


class ResaLoss(Objective):
    """``eps``: the Sinkhorn temperature (ReSA: 0.05); ``iterations`` (ReSA: 3); ``temperature``: a fixed
    temperature for the embeddings' similarities (None: the model's logit scale); ``encodings``:
    ``online`` (the current weights') or ``ema`` (the ``train.ema`` average's, ReSA's momentum encoder)."""

    name = "resa"
    tiled = True
    needs = frozenset({"image_encodings"})

    def __init__(self, *, eps: float = 0.05, iterations: int = 3, temperature: float | None = None,
                 encodings: Literal["online", "ema"] = "online", rank: int = 0, world_size: int = 1,
                 chunk_size: int | None = None):
        super().__init__(rank=rank, world_size=world_size, chunk_size=chunk_size)
        if not (isinstance(eps, (int, float)) and eps > 0):
            raise ValueError(f"eps must be > 0, not {eps!r}")
        if not (isinstance(iterations, int) and not isinstance(iterations, bool) and iterations >= 1):
            raise ValueError(f"iterations must be a whole number >= 1, not {iterations!r}")
        if temperature is not None and not (isinstance(temperature, (int, float)) and temperature > 0):
            raise ValueError(f"temperature must be > 0 or null (the model's logit scale), not {temperature!r}")
        if encodings not in ("online", "ema"):
            raise ValueError(f"encodings must be online or ema (train.ema's average), not {encodings!r}")
        self.eps, self.iterations, self.temperature, self.encodings = float(eps), iterations, temperature, encodings
        self.uses_logit_scale = temperature is None

    def largest_matrix(self, batch: int) -> int:
        return self.tiles(batch, batch * self.world_size)  # this rank's rows against every rank's columns

    def targets(self, h_local: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``A`` (whole: for the untiled form and the tests)."""
        h_local, h_all, c, _ = self._scalings(h_local)
        with torch.autocast(h_local.device.type, enabled=False):
            return (h_local @ h_all.T / self.eps + c).softmax(1)

    def _scalings(self, h_local: torch.Tensor):
        with torch.autocast(h_local.device.type, enabled=False):
            h_local = F.normalize(h_local.detach().to(torch.promote_types(h_local.dtype, torch.float32)), dim=-1)
            h_all = gather_no_grad(h_local, self.world_size)
            c, lse = sinkhorn_columns(h_local, h_all, self.eps, self.iterations, self.chunk_size, self.world_size)
            # A_ii, each sample's target on its own caption: 1 is CLIP's one-hot, lower is what the
            # assignment spreads over other samples (a diagnostic, logged as resa/self_weight)
            own = c[self.rank * h_local.shape[0]:(self.rank + 1) * h_local.shape[0]]
            self_weight = torch.exp((h_local * h_local).sum(1) / self.eps + own - lse).mean()
        return h_local, h_all, c, self_weight

    def forward(self, *, image_features: torch.Tensor, text_features: torch.Tensor,
                logit_scale: torch.Tensor | float, image_encodings: torch.Tensor | None = None,
                **extra) -> dict[str, torch.Tensor]:
        """``image_features``, ``text_features (B, D)`` normalised; ``image_encodings (B, P)``: the image
        tower's pre-projection outputs of the same images (normalised here; never back-propagated)."""
        if image_encodings is None:
            raise ValueError("resa needs image_encodings (the image tower's outputs before its projection)")
        scale = logit_scale if self.temperature is None else 1.0 / self.temperature
        x, y = image_features, text_features
        all_x = gather_with_grad(x, self.world_size)
        all_y = gather_with_grad(y, self.world_size)
        h_local, h_all, c, self_weight = self._scalings(image_encodings)
        if self.chunk_size is not None:
            loss = soft_pair_ce(x, y, all_x, all_y, h_local, h_all, self.eps, scale, self.chunk_size, self.world_size,
                                col_bias=c)
            return {"resa_loss": loss, "resa/self_weight": self_weight}
        with torch.autocast(x.device.type, enabled=False):
            a = (h_local @ h_all.T / self.eps + c).softmax(1)
        logits_i = scale * x @ all_y.T
        logits_t = scale * y @ all_x.T
        ce_i = -(a * F.log_softmax(logits_i.float(), dim=1)).sum(1).mean()
        ce_t = -(a * F.log_softmax(logits_t.float(), dim=1)).sum(1).mean()
        return {"resa_loss": 0.5 * (ce_i + ce_t), "resa/self_weight": self_weight}
