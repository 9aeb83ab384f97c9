"""Captioning (CoCa's caption loss, Yu et al., 2022): teacher-forced next-token cross-entropy of the caption
decoder's logits against the caption's next tokens, padding ignored, averaged over the batch's non-padding
tokens:

    L = -1/T sum_i sum_{t: y_it != pad} log softmax(z_it)[y_it],   T = #{(i, t): y_it != pad}

``z (B, L-1, V)``: ``caption_logits``; ``y = tokens[:, 1:]``: ``caption_labels`` (the need ``caption``, from
the model's forward: :func:`mmpretrain.models.caption.caption_outputs`). Weighted beside a contrastive
term in ``loss:``, ``clip`` (weight 1) + ``caption`` (weight 2) is ``open_clip.loss.CoCaLoss(
caption_loss_weight=2, clip_loss_weight=1)``. Per rank: no gather; the mean over ranks of each rank's
average is the trainer's loss (DDP averages gradients), as in open_clip's trainer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmpretrain.losses.base import Objective


class CaptionLoss(Objective):

    name = "caption"
    needs = frozenset({"caption"})
    uses_logit_scale = False

    def __init__(self, *, pad_id: int = 0, rank: int = 0, world_size: int = 1, chunk_size: int | None = None):
        super().__init__(rank=rank, world_size=world_size, chunk_size=chunk_size)
        if not isinstance(pad_id, int) or isinstance(pad_id, bool):
            raise ValueError(f"caption: pad_id must be the tokenizer's padding id (0 for CLIP's), not {pad_id!r}")
        self.pad_id = pad_id
        self.per_sample: int | None = None  # logits per sample, (L-1) x V: set by the trainer from the model

    def largest_matrix(self, batch: int) -> int:
        """The logits and their softmax, ``batch x (L-1) x V``: per rank, never gathered; ``(L-1) x V`` is the
        decoder's, set with :meth:`for_decoder` (unset: the contrastive default)."""
        return super().largest_matrix(batch) if self.per_sample is None else batch * self.per_sample

    def for_decoder(self, context_length: int, vocab_size: int) -> CaptionLoss:
        """This objective's matrix for a decoder over ``context_length`` tokens and ``vocab_size`` ids."""
        self.per_sample = (context_length - 1) * vocab_size
        return self

    def forward(self, caption_logits: torch.Tensor, caption_labels: torch.Tensor, **_) -> dict[str, torch.Tensor]:
        # the softmax in at least fp32 (bf16 logits under autocast)
        z = caption_logits.to(torch.promote_types(caption_logits.dtype, torch.float32))
        loss = F.cross_entropy(z.flatten(0, 1), caption_labels.flatten(), ignore_index=self.pad_id)
        return {"caption_loss": loss}
