"""VRN, variance reduction of negative similarities ("On the Similarities of Embeddings in
Contrastive Learning", ICML 2025):

    L_vrn = mean_{i != j} (x_i.y_j - delta)^2,   delta = -1/(n-1)

over cross-modal negatives, ``n`` the dataset size (the similarity every negative pair would have
if the ``n`` embeddings formed a regular simplex). Use as ``L + lambda L_vrn`` (paper's code: 30).
Features ``(B, D)``. Distributed: local rows against gathered columns; each rank normalises by its
``b (N - 1)`` pairs so the mean over ranks is the global mean.
"""

from __future__ import annotations

import torch

from mmpretrain.losses.base import Objective
from mmpretrain.losses.distributed import gather_with_grad


class VrnLoss(Objective):

    name = "vrn"
    uses_logit_scale = False
    needs = frozenset({"dataset_size"})

    def __init__(self, *, delta: float | None = None, dataset_size: int | None = None, rank: int = 0,
                 world_size: int = 1, chunk_size: int | None = None):
        super().__init__(rank=rank, world_size=world_size, chunk_size=chunk_size)
        if delta is None and dataset_size is not None:
            if dataset_size < 2:
                raise ValueError("dataset_size must be at least 2")
            delta = -1.0 / (dataset_size - 1)
        self.delta = delta

    def largest_matrix(self, batch: int) -> int:
        return batch * batch * self.world_size  # this rank's rows against every rank's columns

    def forward(self, *, image_features: torch.Tensor, text_features: torch.Tensor, **extra) -> dict[str, torch.Tensor]:
        if self.delta is None:
            raise ValueError("vrn needs delta or dataset_size (the trainer passes the dataset size)")
        x = image_features
        b = x.shape[0]
        all_y = gather_with_grad(text_features, self.world_size)
        sq = (x @ all_y.T - self.delta) ** 2
        idx = torch.arange(b, device=x.device)
        sq = sq.index_put((idx, idx + self.rank * b), torch.zeros((), dtype=sq.dtype, device=sq.device))
        return {"vrn_loss": sq.sum() / (b * (all_y.shape[0] - 1))}
