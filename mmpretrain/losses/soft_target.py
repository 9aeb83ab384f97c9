"""Soft targets from a frozen text encoder: X-CLR (Sobal et al., ICLR 2025, "X-Sample Contrastive
Loss: Improving Contrastive Learning with Sample Similarity Graphs").

Targets ``G = softmax_r(T T^T / tau_s)`` from frozen caption embeddings ``T (N, E)`` (detached).

* ``space="image_text"`` (soft-target CLIP, symmetric)::

      L = -1/(2N) sum_ij G_ij [log softmax_j(s x_i.y_j) + log softmax_j(s y_i.x_j)]

  ``G = I`` gives CLIP.
* ``space="image_image"`` (the paper's form): ``Z = X X'^T / tau`` over two views
  (``image_features_2``); ``L = -1/N sum_ij G_ij log softmax_j(Z_ij)``. With one view the trivial
  diagonal is masked out of both ``G`` and ``Z``.

``chunk_size`` tiles the image_text form and the two-view image_image form (never ``B x B``); the
single-view form needs the masked diagonal and is computed whole.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from mmpretrain.losses.base import Objective
from mmpretrain.losses.distributed import gather_no_grad, gather_with_grad
from mmpretrain.losses.tiled import pair_lse, soft_pair_ce, target_matmul


def soft_targets(local_t: torch.Tensor, all_t: torch.Tensor, tau: float, mask_offset: int | None = None):
    """Rows of ``softmax_r(T T^T / tau)`` for ``local_t (b, E)`` against ``all_t (N, E)``.
    ``mask_offset`` masks entry ``(i, i + offset)`` (the trivial self pair). In at least fp32 with
    autocast off: a bf16 ``T T^T / tau`` at tau = 0.1 moves the targets themselves."""
    with torch.autocast(local_t.device.type, enabled=False):
        local_t, all_t = (t.to(torch.promote_types(t.dtype, torch.float32)) for t in (local_t, all_t))
        sim = (local_t @ all_t.T) / tau
        if mask_offset is not None:
            idx = torch.arange(local_t.shape[0], device=sim.device)
            sim[idx, idx + mask_offset] = float("-inf")
        return sim.softmax(dim=1)


class SoftTargetLoss(Objective):

    name = "soft_target"
    tiled = True
    needs = frozenset({"targets"})

    def __init__(
        self,
        *,
        target_temperature: float = 0.1,
        space: Literal["image_text", "image_image"] = "image_text",
        temperature: float = 0.1,
        rank: int = 0,
        world_size: int = 1,
        chunk_size: int | None = None,
    ):
        super().__init__(rank=rank, world_size=world_size, chunk_size=chunk_size)
        if target_temperature <= 0 or temperature <= 0:
            raise ValueError("target_temperature and temperature must be > 0")
        if space not in ("image_text", "image_image"):
            raise ValueError(f"space must be 'image_text' or 'image_image', got {space!r}")
        self.target_temperature = target_temperature
        self.space = space
        self.temperature = temperature

    def largest_matrix(self, batch: int) -> int:
        return self.tiles(batch, batch * self.world_size)  # this rank's rows against every rank's columns

    def forward(
        self,
        *,
        image_features: torch.Tensor,
        text_features: torch.Tensor,
        logit_scale: torch.Tensor | float,
        logit_bias: torch.Tensor | None = None,
        target_embeddings: torch.Tensor | None = None,
        image_features_2: torch.Tensor | None = None,
        **extra,
    ) -> dict[str, torch.Tensor]:
        """``image_features``, ``text_features``, ``image_features_2`` ``(B, D)``; ``target_embeddings (B, E)``."""
        if target_embeddings is None:
            raise ValueError(
                "soft_target needs target_embeddings (frozen caption embeddings): run `data_tools embed` "
                "on the shards or set targets.source=online"
            )
        b = image_features.shape[0]
        # targets in at least fp32 (stored as fp16), in the features' precision when higher
        t_dtype = torch.promote_types(image_features.dtype, torch.float32)
        t_local = F.normalize(target_embeddings.detach().to(t_dtype), dim=-1)
        t_all = gather_no_grad(t_local, self.world_size)
        offset = self.rank * b
        # Every rank computes its own rows against all columns; the mean over ranks of these
        # row-means is the global mean, and gather_with_grad sums the column gradients.
        if self.space == "image_text":
            all_img = gather_with_grad(image_features, self.world_size)
            all_txt = gather_with_grad(text_features, self.world_size)
            if self.chunk_size is not None:
                return {"soft_target_loss": self._tiled_image_text(
                    image_features, text_features, all_img, all_txt, t_local, t_all, logit_scale)}
            g = soft_targets(t_local, t_all, self.target_temperature)
            logits_i = logit_scale * image_features @ all_txt.T
            logits_t = logit_scale * text_features @ all_img.T
            if logit_bias is not None:
                logits_i, logits_t = logits_i + logit_bias, logits_t + logit_bias
            ce_i = -(g * F.log_softmax(logits_i, dim=1)).sum(1).mean()
            ce_t = -(g * F.log_softmax(logits_t, dim=1)).sum(1).mean()
            return {"soft_target_loss": 0.5 * (ce_i + ce_t)}
        if self.chunk_size is not None and image_features_2 is None:
            raise ValueError("tiled image_image soft targets need a second view (image_features_2)")
        if image_features_2 is not None:
            other = gather_with_grad(image_features_2, self.world_size)
            if self.chunk_size is not None:
                scale = torch.tensor(1 / self.temperature, dtype=image_features.dtype, device=image_features.device)
                row = pair_lse(image_features, other, scale, self.chunk_size)
                cross = (image_features * target_matmul(other, t_local, t_all, self.target_temperature,
                                                        self.chunk_size)).sum(1) * scale
                return {"soft_target_loss": (row - cross).mean()}
            g = soft_targets(t_local, t_all, self.target_temperature)
            z = image_features @ other.T / self.temperature
        else:
            other = gather_with_grad(image_features, self.world_size)
            g = soft_targets(t_local, t_all, self.target_temperature, mask_offset=offset)
            z = image_features @ other.T / self.temperature
            idx = torch.arange(b, device=z.device)
            z = z.index_put((idx, idx + offset), torch.tensor(float("-inf"), device=z.device, dtype=z.dtype))
        logp = F.log_softmax(z, dim=1)
        # masked entries have g = 0 and logp = -inf; 0 * -inf would be nan
        loss = -(g * logp.masked_fill(g == 0, 0.0)).sum(1).mean()
        return {"soft_target_loss": loss}

    def _tiled_image_text(self, x, y, all_x, all_y, t_local, t_all, scale):
        """``CE_i = LSE_i - sum_j G_ij z_ij``: LSEs from tiles, the cross term as ``x_i . (G Y)_i``
        with ``G Y`` built tile by tile. Bias cancels (rows of G sum to 1)."""
        # the tiled functions run in at least fp32 (tiled.py); the targets stay in theirs
        return soft_pair_ce(x, y, all_x, all_y, t_local, t_all, self.target_temperature, scale, self.chunk_size,
                            self.world_size)
