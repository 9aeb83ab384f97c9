"""CLIP / InfoNCE (Radford et al., 2021, "Learning Transferable Visual Models From Natural Language
Supervision", Eq. in Fig. 3):

    L = 1/2 [ CE(s X Y^T, arange(N)) + CE(s Y X^T, arange(N)) ]

with ``X (N, D)`` image and ``Y (N, D)`` text features, L2-normalised, ``s`` the exponentiated scale.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmpretrain.losses.base import Objective
from mmpretrain.losses.distributed import gather_no_grad, gather_with_grad, scale_grad
from mmpretrain.losses.tiled import pair_ce


class ClipLoss(Objective):
    """Symmetric InfoNCE over the global batch.

    Options: ``local_loss`` computes only this rank's rows ``s X_local Y_all^T`` (labels offset by
    ``rank * B``); ``gather_with_grad`` keeps the graph through the gather. Every supported
    combination gives, as the mean over ranks with DDP-averaged gradients, the value and gradient of
    one process holding the whole batch. ``local_loss`` without ``gather_with_grad`` cannot (the
    other ranks' columns would carry no gradient, open_clip #616/#894) and is rejected.
    ``chunk_size``: tiled log-sum-exp over ``chunk x chunk`` tiles recomputed in backward; no
    ``B x B`` logits are ever held (the global form gets both directions from one pass).
    """

    name = "clip"
    tiled = True


    def __init__(
        self,
        *,
        local_loss: bool = False,
        gather_with_grad: bool = True,
        rank: int = 0,
        world_size: int = 1,
        chunk_size: int | None = None,
    ):
        super().__init__(rank=rank, world_size=world_size, chunk_size=chunk_size)
        if local_loss and not gather_with_grad:
            raise ValueError(
                "local_loss=true needs gather_with_grad=true: without it the gradient of other ranks' "
                "columns is lost (open_clip #616); set gather_with_grad=true"
            )
        self.local_loss = local_loss
        self.gather_with_grad = gather_with_grad

    def largest_matrix(self, batch: int) -> int:
        gathered = batch * self.world_size
        return self.tiles(batch if self.local_loss else gathered, gathered)

    def forward(
        self,
        *,
        image_features: torch.Tensor,
        text_features: torch.Tensor,
        logit_scale: torch.Tensor | float,
        logit_bias: torch.Tensor | None = None,
        target_embeddings: torch.Tensor | None = None,
        **extra,
    ) -> dict[str, torch.Tensor]:
        """``image_features (B, D)``, ``text_features (B, D)`` local to this rank, normalised."""
        b = image_features.shape[0]
        if not self.gather_with_grad and self.world_size > 1:
            # Each rank back-propagates only into its own slice of the features, which DDP's 1/world
            # averaging would shrink: scale that slice's gradient back up. The scale's (and bias's)
            # gradient is already the whole batch's on every rank and stays as it is.
            image_features = scale_grad(image_features, float(self.world_size))
            text_features = scale_grad(text_features, float(self.world_size))
        if self.gather_with_grad or self.world_size == 1:
            all_img = gather_with_grad(image_features, self.world_size)
            all_txt = gather_with_grad(text_features, self.world_size)
        else:
            all_img = _gather_keep_local(image_features, self.rank, self.world_size)
            all_txt = _gather_keep_local(text_features, self.rank, self.world_size)
        if self.chunk_size is not None:
            loss = self._tiled(image_features, text_features, all_img, all_txt, logit_scale)
        elif self.local_loss:
            logits_i = logit_scale * image_features @ all_txt.T
            logits_t = logit_scale * text_features @ all_img.T
            labels = torch.arange(b, device=image_features.device) + self.rank * b
        else:
            logits_i = logit_scale * all_img @ all_txt.T
            logits_t = logits_i.T
            labels = torch.arange(all_img.shape[0], device=image_features.device)
        if self.chunk_size is None:
            # a logit bias shifts every logit of a row equally: cross-entropy ignores it
            loss = 0.5 * (F.cross_entropy(logits_i, labels) + F.cross_entropy(logits_t, labels))
        return {"clip_loss": loss}

    def _tiled(self, x, y, all_x, all_y, scale):
        """CE = LSE - positive logit, with the LSEs from column tiles (never B x B)."""
        scale = torch.as_tensor(scale, device=x.device)  # pair_ce runs in at least fp32
        if self.local_loss:
            offset = self.rank * x.shape[0]
            row_i, _ = pair_ce(x, all_y, scale, self.chunk_size, offset)
            row_t, _ = pair_ce(y, all_x, scale, self.chunk_size, offset)
        else:
            row_i, row_t = pair_ce(all_x, all_y, scale, self.chunk_size, 0, want_col=True)
        return 0.5 * (row_i.mean() + row_t.mean())


def _gather_keep_local(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    parts = list(gather_no_grad(x.detach(), world_size).chunk(world_size))
    parts[rank] = x
    return torch.cat(parts, dim=0)
