"""The largest batch-by-batch matrix an objective builds in one step, traced: every float tensor of two
or more dimensions that one forward and backward produce, on one rank of ``world_size`` (the gathers
replaced by copies of this rank's batch, so shapes are those of the real run), without vectors and the
feature matrices (``batch x dim``, ``batch x 2 dim``). Tests hold each objective's declared :meth:`largest_matrix` to it."""

from __future__ import annotations

import math
import sys
from contextlib import ExitStack
from unittest import mock

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from mmpretrain.losses.base import total_of

# feature and embedding widths no batch, chunk or cluster count in a test uses; the caption decoder's
# context (its logits cover CAPTION - 1 positions) and vocabulary
DIM, EMB = 97, 53
CAPTION, VOCAB = 7, 89
# the self-supervised terms' heads' prototypes, the tower's patches (masked_prediction masks half)
PROTOTYPES, PATCHES = 61, 16


class _Peak(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.numel, self.shape = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if (isinstance(t, torch.Tensor) and t.dim() >= 2 and t.dtype.is_floating_point
                    and min(t.shape[-2:]) > 1 and not any(d % DIM == 0 or d % EMB == 0 for d in t.shape[-2:])
                    and t.numel() > self.numel):
                self.numel, self.shape = t.numel(), tuple(t.shape)
        return out


def _replicate(x: torch.Tensor, world_size: int) -> torch.Tensor:
    return x if world_size == 1 else torch.cat([x] * world_size, dim=0)


def traced_peak(objective, batch: int, world_size: int, steps: int = 3, seed: int = 0) -> tuple[int, tuple]:
    """``(elements, shape)`` of the largest matrix ``objective`` (built for ``world_size``, rank 0)
    makes over ``steps`` forward+backward calls on random unit features of ``batch`` rows."""
    gen = torch.Generator().manual_seed(seed)
    peak = _Peak()
    if hasattr(objective, "for_decoder"):  # the caption decoder's shape, as the trainer sets it
        objective.for_decoder(CAPTION, VOCAB)
    if hasattr(objective, "for_tower"):  # the tower's patch count, as the trainer sets it
        objective.for_tower(PATCHES)
    local = objective.local_crops.count if getattr(objective, "local_crops", None) is not None else 1
    masked = next((t.masked_count() for t in getattr(objective, "terms", []) if hasattr(t, "masked_count")), 1)
    with ExitStack() as stack:
        for name, module in list(sys.modules.items()):
            if name.startswith("mmpretrain.losses"):
                for fn in ("gather_with_grad", "gather_no_grad"):
                    if hasattr(module, fn):
                        stack.enter_context(mock.patch.object(module, fn, _replicate))
                if hasattr(module, "logsumexp_ranks"):  # world_size copies of this rank's values
                    stack.enter_context(mock.patch.object(module, "logsumexp_ranks",
                                                          lambda x, world_size: x + math.log(world_size)))
        # rank 0's broadcasts (regions' centroids) leave its tensors as they are
        stack.enter_context(mock.patch("torch.distributed.broadcast", lambda tensor, src=0, **kw: None))
        # the self-supervised centres' sums over ranks: this rank's (its own rows and counts)
        stack.enter_context(mock.patch("torch.distributed.all_reduce", lambda tensor, **kw: None))
        for step in range(steps):
            img = torch.randn(batch, DIM, generator=gen, requires_grad=True)
            txt = torch.randn(batch, DIM, generator=gen, requires_grad=True)
            neg = torch.randn(batch, DIM, generator=gen, requires_grad=True)
            inputs = dict(
                image_features=F.normalize(img, dim=-1), text_features=F.normalize(txt, dim=-1),
                logit_scale=torch.tensor(10.0), logit_bias=torch.tensor(-10.0),
                target_embeddings=torch.randn(batch, EMB, generator=gen),
                # a two-teacher ensemble, each member EMB wide
                teacher_image_embeddings=torch.randn(batch, 2 * EMB, generator=gen),
                teacher_text_embeddings=torch.randn(batch, 2 * EMB, generator=gen), teacher_dims=[EMB, EMB],
                labels=torch.randint(0, 4, (batch,), generator=gen), sample_index=torch.arange(batch) + step * batch,
                # hard negatives (some samples without one) and the image tower's pre-projection encodings
                negative_text_features=F.normalize(neg, dim=-1), negative_mask=torch.rand(batch, generator=gen) > 0.3,
                image_encodings=torch.randn(batch, EMB, generator=gen),
                caption_logits=torch.randn(batch, CAPTION - 1, VOCAB, generator=gen, requires_grad=True),
                caption_labels=torch.randint(0, VOCAB, (batch, CAPTION - 1), generator=gen),
                student_local=torch.randn(batch, local, PROTOTYPES, generator=gen, requires_grad=True),
                teacher_global=torch.randn(batch, PROTOTYPES, generator=gen),
                student_masked=torch.randn(batch, masked, PROTOTYPES, generator=gen, requires_grad=True),
                teacher_masked=torch.randn(batch, masked, PROTOTYPES, generator=gen),
                step=step * 1000, epoch=step * 1000 + 1)
            with peak:
                out = objective(**inputs)
                total_of(out).backward()
            getattr(objective, "commit_step", lambda: None)()
    return peak.numel, peak.shape
