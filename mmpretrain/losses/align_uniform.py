"""Alignment and uniformity (Wang & Isola, ICML 2020, "Understanding Contrastive Representation
Learning through Alignment and Uniformity on the Hypersphere", Eqs. 4-5), t = 2:

    align = mean_i ||x_i - y_i||^2
    uniform(X) = log mean_{i != j} exp(-2 ||x_i - x_j||^2)
    L = align + (uniform(X) + uniform(Y)) / 2

Features ``(B, D)``, normalised. Distributed: ``align`` is a mean of local terms; ``uniform`` is the
log of a global mean, so every rank computes it on the gathered batch (with gradient); the mean
over ranks then equals one process, and DDP's averaging of the world-times-summed gradient too.
"""

from __future__ import annotations

import math

import torch

from mmpretrain.losses.base import Objective
from mmpretrain.losses.distributed import gather_with_grad


def uniformity(x: torch.Tensor, t: float = 2.0) -> torch.Tensor:
    n = x.shape[0]
    sq = (2 - 2 * x @ x.T).clamp_min(0)  # ||x_i - x_j||^2 for unit vectors
    off = ~torch.eye(n, dtype=torch.bool, device=x.device)
    return torch.logsumexp(-t * sq[off], 0) - math.log(n * (n - 1))


class AlignUniformLoss(Objective):

    name = "align_uniform"
    uses_logit_scale = False

    def __init__(self, *, t: float = 2.0, rank: int = 0, world_size: int = 1, chunk_size: int | None = None):
        super().__init__(rank=rank, world_size=world_size, chunk_size=chunk_size)
        self.t = t

    def forward(self, *, image_features: torch.Tensor, text_features: torch.Tensor, **extra) -> dict[str, torch.Tensor]:
        x, y = image_features, text_features
        align = (x - y).pow(2).sum(1).mean()
        all_x, all_y = gather_with_grad(x, self.world_size), gather_with_grad(y, self.world_size)
        uniform = 0.5 * (uniformity(all_x, self.t) + uniformity(all_y, self.t))
        return {"align_uniform_loss": align + uniform, "align": align.detach(), "uniform": uniform.detach()}
