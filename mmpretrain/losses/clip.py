"""CLIP / InfoNCE (Radford et al., 2021, "Learning Transferable Visual Models From Natural Language
Supervision", Eq. in Fig. 3):

    L = 1/2 [ CE(s X Y^T, arange(N)) + CE(s Y X^T, arange(N)) ]

with ``X (N, D)`` image and ``Y (N, D)`` text features, L2-normalised, ``s`` the exponentiated scale.

``hard_negatives`` (NegCLIP: Yuksekgonul et al., ICLR 2023, "When and why vision-language models behave
like bags-of-words"): each sample's negative caption ``N_j`` (``negative_captions`` in its json; one
drawn per epoch) joins the image->text softmax as an extra column for every image of the global batch,
as NegCLIP's training code concatenates the batch's negatives after its captions; the text->image term
keeps the positive captions only:

    L = 1/2 [ CE(s X [Y; N_valid]^T, arange(N)) + CE(s Y X^T, arange(N)) ]

A sample without negatives adds no column (its image still sees every other sample's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmpretrain.losses.base import Objective
from mmpretrain.losses.distributed import gather_no_grad, gather_with_grad, scale_grad
from mmpretrain.losses.tiled import MASKED, pair_ce


class ClipLoss(Objective):
    """Symmetric InfoNCE over the global batch.

    Options: ``local_loss`` computes only this rank's rows ``s X_local Y_all^T`` (labels offset by
    ``rank * B``); ``gather_with_grad`` keeps the graph through the gather. Every supported
    combination gives, as the mean over ranks with DDP-averaged gradients, the value and gradient of
    one process holding the whole batch. ``local_loss`` without ``gather_with_grad`` cannot (the
    other ranks' columns would carry no gradient, open_clip #616/#894) and is rejected.
    ``chunk_size``: tiled log-sum-exp over ``chunk x chunk`` tiles recomputed in backward; no
    ``B x B`` logits are ever held (the global form gets both directions from one pass).
    ``hard_negatives``: the NegCLIP columns above; the trainer then provides ``negative_text_features
    (B, D)`` and ``negative_mask (B,)`` (which samples have one).
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
        hard_negatives: bool = False,
    ):
        super().__init__(rank=rank, world_size=world_size, chunk_size=chunk_size)
        if not isinstance(hard_negatives, bool):
            raise ValueError(f"hard_negatives must be true or false, not {hard_negatives!r}")
        self.needs = frozenset({"negatives"} if hard_negatives else ())
        if local_loss and not gather_with_grad:
            raise ValueError(
                "local_loss=true needs gather_with_grad=true: without it the gradient of other ranks' "
                "columns is lost (open_clip #616); set gather_with_grad=true"
            )
        self.local_loss = local_loss
        self.gather_with_grad = gather_with_grad

    def largest_matrix(self, batch: int) -> int:
        gathered = batch * self.world_size
        cols = 2 * gathered if "negatives" in self.needs else gathered  # the captions, then the negatives
        return self.tiles(batch if self.local_loss else gathered, cols)

    def forward(
        self,
        *,
        image_features: torch.Tensor,
        text_features: torch.Tensor,
        logit_scale: torch.Tensor | float,
        logit_bias: torch.Tensor | None = None,
        target_embeddings: torch.Tensor | None = None,
        negative_text_features: torch.Tensor | None = None,
        negative_mask: torch.Tensor | None = None,
        **extra,
    ) -> dict[str, torch.Tensor]:
        """``image_features (B, D)``, ``text_features (B, D)`` local to this rank, normalised; with
        ``hard_negatives``, ``negative_text_features (B, D)`` and ``negative_mask (B,)`` too."""
        b = image_features.shape[0]
        negatives = "negatives" in self.needs
        if negatives and (negative_text_features is None or negative_mask is None):
            raise ValueError("clip with hard_negatives needs negative_text_features and negative_mask")
        if not self.gather_with_grad and self.world_size > 1:
            # Each rank back-propagates only into its own slice of the features, which DDP's 1/world
            # averaging would shrink: scale that slice's gradient back up. The scale's (and bias's)
            # gradient is already the whole batch's on every rank and stays as it is.
            image_features = scale_grad(image_features, float(self.world_size))
            text_features = scale_grad(text_features, float(self.world_size))
            if negatives:
                negative_text_features = scale_grad(negative_text_features, float(self.world_size))
        gather = (lambda x: gather_with_grad(x, self.world_size)) if self.gather_with_grad or self.world_size == 1 \
            else (lambda x: _gather_keep_local(x, self.rank, self.world_size))
        all_img, all_txt = gather(image_features), gather(text_features)
        cols, col_bias = all_txt, None
        if negatives:  # the batch's negatives after its captions; a sample without one adds no column
            mask = gather_no_grad(negative_mask.to(device=all_txt.device, dtype=torch.float32), self.world_size)
            cols = torch.cat([all_txt, gather(negative_text_features.to(all_txt.dtype))])
            col_bias = torch.cat([torch.zeros_like(mask), (1 - mask) * MASKED])
        if self.chunk_size is not None:
            loss = self._tiled(image_features, text_features, all_img, all_txt, cols, col_bias, logit_scale)
        elif self.local_loss:
            logits_i = logit_scale * image_features @ cols.T
            logits_t = logit_scale * text_features @ all_img.T
            labels = torch.arange(b, device=image_features.device) + self.rank * b
        else:
            logits_i = logit_scale * all_img @ cols.T
            logits_t = logits_i[:, :all_txt.shape[0]].T  # the captions' columns (before any negatives)
            labels = torch.arange(all_img.shape[0], device=image_features.device)
        if self.chunk_size is None and col_bias is not None:
            logits_i = logits_i + col_bias.to(logits_i.dtype)
        if self.chunk_size is None:
            # a logit bias shifts every logit of a row equally: cross-entropy ignores it
            loss = 0.5 * (F.cross_entropy(logits_i, labels) + F.cross_entropy(logits_t, labels))
        if negatives:  # logged: 0 says the data carry no negative_captions (the option then costs, buys nothing)
            return {"clip_loss": loss, "clip/negative_share": mask.mean()}
        return {"clip_loss": loss}

    def _tiled(self, x, y, all_x, all_y, cols, col_bias, scale):
        """CE = LSE - positive logit, with the LSEs from column tiles (never B x B)."""
        scale = torch.as_tensor(scale, device=x.device)  # pair_ce runs in at least fp32
        if self.local_loss:
            offset = self.rank * x.shape[0]
            row_i, _ = pair_ce(x, cols, scale, self.chunk_size, offset, col_bias=col_bias)
            row_t, _ = pair_ce(y, all_x, scale, self.chunk_size, offset)
        else:
            # the column statistics of the captions are the text->image term; a negative's are not used
            row_i, col = pair_ce(all_x, cols, scale, self.chunk_size, 0, want_col=True, col_bias=col_bias)
            row_t = col[:all_y.shape[0]]
        return 0.5 * (row_i.mean() + row_t.mean())


def _gather_keep_local(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    parts = list(gather_no_grad(x.detach(), world_size).chunk(world_size))
    parts[rank] = x
    return torch.cat(parts, dim=0)
