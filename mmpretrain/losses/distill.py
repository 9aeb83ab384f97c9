"""Distillation from stored teacher embeddings (MobileCLIP, Vasu et al., CVPR 2024, "MobileCLIP: Fast
Image-Text Models through Multi-Modal Reinforced Training", Eq. 2; ml-mobileclip's ``DRClipLoss``):
the student's image->text and text->image similarity distributions over the (gathered) batch are
pulled towards the teacher's, by cross-entropy (the KL divergence up to the teacher's entropy, a
constant):

    P_i2t = 1/M sum_m softmax_j(s_T u^m_i . v^m_j)     (the ensemble's M softmaxes averaged)
    L_i2t = -1/B sum_i sum_j P_i2t[i, j] log softmax_j(s x_i . y_j)
    L = (L_i2t + L_t2i) / 2

with ``x, y`` the student's image and text features, ``u^m, v^m`` teacher ``m``'s stored image and
text embeddings (``teacher_image_embeddings (B, E)``, ``teacher_text_embeddings (B, E)``: the members'
rows side by side, split by ``teacher_dims``; each member renormalised), ``s_T`` the teacher's logit
scale (fixed: ``teacher_scale``, 100 in DataCompDR). For one teacher this is open_clip's
``DistillClipLoss.distill_loss`` with the teacher's scale fixed.

Distributed: this rank's rows against every rank's columns (student features gathered with their
gradient, teacher rows without), so the mean over ranks is the one-process loss over the global
batch. ``chunk_size``: ``LSE_j - sum_j P_ij z_ij`` from tiles, the cross term as ``x_i . (P Y)_i``
with ``P Y`` built tile by tile; no ``B x B`` matrix is held.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmpretrain.losses.base import Objective
from mmpretrain.losses.distributed import gather_no_grad, gather_with_grad
from mmpretrain.losses.tiled import pair_lse, target_matmul


def split_members(rows: torch.Tensor, dims) -> list[torch.Tensor]:
    """An ensemble's rows ``(B, sum dims)`` as one L2-normalised ``(B, dim)`` block per member."""
    dims = list(dims) if dims else [rows.shape[1]]
    if sum(dims) != rows.shape[1]:
        raise ValueError(f"distill: teacher rows of width {rows.shape[1]}, teacher_dims {dims} sum to {sum(dims)}")
    return [F.normalize(r, dim=-1) for r in rows.split(dims, dim=1)]


class DistillLoss(Objective):
    """Options: ``teacher_scale`` (the teacher's logit scale, fixed; 100 as DataCompDR)."""

    name = "distill"
    tiled = True
    needs = frozenset({"teacher"})

    def __init__(self, *, teacher_scale: float = 100.0, rank: int = 0, world_size: int = 1,
                 chunk_size: int | None = None):
        super().__init__(rank=rank, world_size=world_size, chunk_size=chunk_size)
        if not teacher_scale > 0:
            raise ValueError(f"distill: teacher_scale={teacher_scale} must be > 0")
        self.teacher_scale = float(teacher_scale)

    def largest_matrix(self, batch: int) -> int:
        return self.tiles(batch, batch * self.world_size)  # this rank's rows against every rank's columns

    def forward(self, *, image_features: torch.Tensor, text_features: torch.Tensor,
                logit_scale: torch.Tensor | float, teacher_image_embeddings: torch.Tensor | None = None,
                teacher_text_embeddings: torch.Tensor | None = None, teacher_dims=None,
                **extra) -> dict[str, torch.Tensor]:
        if teacher_image_embeddings is None or teacher_text_embeddings is None:
            raise ValueError("distill needs teacher_image_embeddings and teacher_text_embeddings: embed the shards "
                             "with a teacher (`python -m data_tools embed DIR --image-model M`)")
        x, y = image_features, text_features
        # the teacher's side in at least fp32 (stored as fp16), whatever the autocast
        t_dtype = torch.promote_types(x.dtype, torch.float32)
        tu = split_members(teacher_image_embeddings.detach().to(t_dtype), teacher_dims)
        tv = split_members(teacher_text_embeddings.detach().to(t_dtype), teacher_dims)
        all_tu = [gather_no_grad(u, self.world_size) for u in tu]
        all_tv = [gather_no_grad(v, self.world_size) for v in tv]
        all_x, all_y = gather_with_grad(x, self.world_size), gather_with_grad(y, self.world_size)
        if self.chunk_size is not None:
            return {"distill_loss": self._tiled(x, y, all_x, all_y, tu, tv, all_tu, all_tv, logit_scale)}
        with torch.autocast(x.device.type, enabled=False):
            p_i = self._teacher_probs(tu, all_tv)
            p_t = self._teacher_probs(tv, all_tu)
            logits_i = (logit_scale * x @ all_y.T).to(t_dtype)
            logits_t = (logit_scale * y @ all_x.T).to(t_dtype)
            l_i = -(p_i * F.log_softmax(logits_i, dim=1)).sum(1).mean()
            l_t = -(p_t * F.log_softmax(logits_t, dim=1)).sum(1).mean()
        return {"distill_loss": 0.5 * (l_i + l_t)}

    def _teacher_probs(self, rows: list[torch.Tensor], cols: list[torch.Tensor]) -> torch.Tensor:
        """The members' softmaxes averaged (not their rows concatenated)."""
        total = None
        for r, c in zip(rows, cols):  # summed in place: one B x N matrix at a time, never M of them
            p = F.softmax(self.teacher_scale * r @ c.T, dim=1)
            total = p if total is None else total.add_(p)
        return total if len(rows) == 1 else total.div_(len(rows))

    def _tiled(self, x, y, all_x, all_y, tu, tv, all_tu, all_tv, scale):
        scale = torch.as_tensor(scale, device=x.device)  # the tiled functions run in at least fp32
        tau, c = 1.0 / self.teacher_scale, self.chunk_size
        row_i = pair_lse(x, all_y, scale, c)
        row_t = pair_lse(y, all_x, scale, c)
        # (P Y) and (P X), the members' P averaged: P is linear in each member's softmax
        py = sum(target_matmul(all_y, u, v, tau, c) for u, v in zip(tu, all_tv)) / len(tu)
        px = sum(target_matmul(all_x, v, u, tau, c) for v, u in zip(tv, all_tu)) / len(tv)
        cross_i = scale * (x.to(py.dtype) * py).sum(1)
        cross_t = scale * (y.to(px.dtype) * px).sum(1)
        return 0.5 * ((row_i - cross_i).mean() + (row_t - cross_t).mean())
