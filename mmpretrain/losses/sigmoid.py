"""Sigmoid / SigLIP (Zhai et al., ICCV 2023, "Sigmoid Loss for Language Image Pre-Training", Eq. 1):

    L = -1/B sum_i sum_j log sigmoid(z_ij (s x_i.y_j + b)),  z_ii = +1, z_ij = -1 otherwise

computed as ``1/B [sum_ij softplus(s x_i.y_j + b) - sum_i (s x_i.y_i + b)]`` (``-log sigmoid(-l) =
softplus(l)`` and ``softplus(-l) - softplus(l) = -l``). ``within_view_negatives`` ("On the
Similarities of Embeddings in Contrastive Learning", ICML 2025) adds the image-image and text-text
off-diagonal pairs as negatives: ``+ 1/B sum_{i!=j} [softplus(s x_i.x_j + b) + softplus(s y_i.y_j + b)]``.
``hard_negatives`` (NegCLIP's hard-negative captions, here as sigmoid pairs): every image against every
negative caption ``n_j`` of the global batch is one more negative pair, ``+ 1/B sum_i sum_{j valid}
softplus(s x_i.n_j + b)``; a sample without a negative adds none.

Distributed: each rank's rows against every rank's columns (gathered with gradient, ``(N, D)``): its
own block holds the positives, the others are negative-only blocks; no ``N x N`` matrix on any rank.
The loss is normalised by the local batch, so the mean over ranks equals one process's loss.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mmpretrain.losses.base import Objective
from mmpretrain.losses.distributed import gather_no_grad, gather_with_grad
from mmpretrain.losses.tiled import MASKED, softplus_sum


class SigmoidLoss(Objective):

    name = "sigmoid"
    tiled = True
    uses_logit_bias = True
    init_logit_scale = math.log(10)
    init_logit_bias = -10.0

    def __init__(self, *, within_view_negatives: bool = False, hard_negatives: bool = False, rank: int = 0,
                 world_size: int = 1, chunk_size: int | None = None):
        super().__init__(rank=rank, world_size=world_size, chunk_size=chunk_size)
        if not isinstance(hard_negatives, bool):
            raise ValueError(f"hard_negatives must be true or false, not {hard_negatives!r}")
        self.within_view_negatives = within_view_negatives
        self.needs = frozenset({"negatives"} if hard_negatives else ())

    def largest_matrix(self, batch: int) -> int:
        return self.tiles(batch, batch * self.world_size)  # this rank's rows against every rank's columns

    def _sum(self, a, b, scale, bias, offset=None, col_bias=None):
        """``sum_ij softplus(l_ij)``, minus the positives' logits ``l_{i,i+offset}`` when given."""
        if self.chunk_size is not None:
            return softplus_sum(a, b, scale, bias, self.chunk_size, offset, col_bias=col_bias)
        # the products may run in bf16/fp16 (autocast); the softplus and its N^2-term sum in at least
        # fp32 (an fp16 sum of 256^2 softplus terms passes 65,504)
        z = a @ b.T
        z = z.to(torch.promote_types(z.dtype, torch.float32)) * scale + bias
        if col_bias is not None:
            z = z + col_bias.to(z.dtype)
        total = F.softplus(z).sum()
        if offset is not None:
            total = total - (scale * (a * b[offset:offset + a.shape[0]]).sum(1) + bias).sum()
        return total

    def forward(self, *, image_features: torch.Tensor, text_features: torch.Tensor,
                logit_scale: torch.Tensor | float, logit_bias: torch.Tensor | float | None = None,
                target_embeddings: torch.Tensor | None = None, negative_text_features: torch.Tensor | None = None,
                negative_mask: torch.Tensor | None = None, **extra) -> dict[str, torch.Tensor]:
        """``image_features (B, D)``, ``text_features (B, D)``: this rank's, normalised; with
        ``hard_negatives``, ``negative_text_features (B, D)`` and ``negative_mask (B,)`` too."""
        if logit_bias is None:
            raise ValueError("sigmoid needs logit_bias (the model owns it; setup initialises it to -10)")
        x, y = image_features, text_features
        b = x.shape[0]
        all_y = gather_with_grad(y, self.world_size)
        loss = self._sum(x, all_y, logit_scale, logit_bias, offset=self.rank * b)
        if self.within_view_negatives:
            all_x = gather_with_grad(x, self.world_size)
            for own, every in ((x, all_x), (y, all_y)):
                diag = F.softplus(logit_scale * (own * own).sum(1) + logit_bias).sum()
                loss = loss + self._sum(own, every, logit_scale, logit_bias) - diag
        if "negatives" in self.needs:
            if negative_text_features is None or negative_mask is None:
                raise ValueError("sigmoid with hard_negatives needs negative_text_features and negative_mask")
            mask = gather_no_grad(negative_mask.to(device=x.device, dtype=torch.float32), self.world_size)
            all_n = gather_with_grad(negative_text_features.to(all_y.dtype), self.world_size)
            loss = loss + self._sum(x, all_n, logit_scale, logit_bias, col_bias=(1 - mask) * MASKED)
            return {"sigmoid_loss": loss / b, "sigmoid/negative_share": mask.mean()}
        return {"sigmoid_loss": loss / b}
