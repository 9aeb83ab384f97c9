"""CWCL (Srinivasa et al., NeurIPS 2023, "CWCL: Cross-Modal Transfer with Continuously Weighted
Contrastive Loss", Eq. 3): weights ``w_ij = (1 + t_i.t_j) / 2`` from frozen caption embeddings,

    L_i2t = -1/B sum_i (sum_j w_ij)^-1 sum_j w_ij log softmax_j(s x_i.y_j)
    L_t2i = CE(s Y X^T, arange(B))
    L = (L_i2t + L_t2i) / 2

Shapes: features ``(B, D)``, ``target_embeddings (B, E)``. Distributed: local rows against gathered
columns (features with gradient, targets without).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmpretrain.losses.base import Objective
from mmpretrain.losses.distributed import gather_no_grad, gather_with_grad


class CwclLoss(Objective):

    name = "cwcl"
    needs = frozenset({"targets"})

    def __init__(self, *, rank: int = 0, world_size: int = 1, chunk_size: int | None = None):
        super().__init__(rank=rank, world_size=world_size, chunk_size=chunk_size)

    def largest_matrix(self, batch: int) -> int:
        return batch * batch * self.world_size  # this rank's rows against every rank's columns

    def forward(self, *, image_features: torch.Tensor, text_features: torch.Tensor,
                logit_scale: torch.Tensor | float, logit_bias=None, target_embeddings: torch.Tensor | None = None,
                **extra) -> dict[str, torch.Tensor]:
        if target_embeddings is None:
            raise ValueError("cwcl needs target_embeddings (frozen caption embeddings)")
        x, y = image_features, text_features
        b = x.shape[0]
        t = F.normalize(target_embeddings.detach().to(x.dtype), dim=-1)
        all_x, all_y = gather_with_grad(x, self.world_size), gather_with_grad(y, self.world_size)
        all_t = gather_no_grad(t, self.world_size)
        w = (1 + t @ all_t.T) / 2
        w = w / w.sum(1, keepdim=True)
        l_i2t = -(w * F.log_softmax(logit_scale * x @ all_y.T, dim=1)).sum(1).mean()
        labels = torch.arange(b, device=x.device) + self.rank * b
        l_t2i = F.cross_entropy(logit_scale * y @ all_x.T, labels)
        return {"cwcl_loss": 0.5 * (l_i2t + l_t2i)}
