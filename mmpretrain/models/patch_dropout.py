"""Patch dropout (FLIP: Li et al. 2023, "Scaling Language-Image Pre-training via Masking"), seeded per sample.

``model.patch_dropout = P`` drops ``P`` of an open_clip ViT's patch tokens (the class token kept) after the
position embeddings are added, as open_clip's ``PatchDropout`` does, in training only: the tower keeps
``max(1, int(N * (1 - P)))`` of its ``N`` patches (open_clip's count), so its transformer runs on about
``1 - P`` of the tokens. open_clip draws the kept set from the global random stream; here it is a function of
the run's seed, the optimizer step and the sample's global index (:func:`kept_patches`), drawn on the host by
the training task and handed to the forward, so that

- an exact resume draws the same masks (no random state to restore),
- grad caching's second forward of a micro-batch uses its first forward's mask (the same indices, sliced
  with the micro-batch), and the rank count does not change a sample's mask;
- evaluation, diagnostics on held-out data and the export never see a mask: only the training step passes one.

:class:`KeptPatches` takes the place of the tower's ``patch_dropout`` module (:func:`install`); without
indices it is the identity, so the model's weights, state dict and export are those of the unmasked tower.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from open_clip.transformer import VisionTransformer
from torch import nn

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 values (wrapping arithmetic): a counter-based hash, so that each
    (seed, step, sample, patch) gets its own uniform 64-bit draw, the same on every machine and version."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def keep_count(num_patches: int, prob: float) -> int:
    """How many of ``num_patches`` a tower with patch dropout ``prob`` keeps (open_clip's rule)."""
    return max(1, int(num_patches * (1 - prob)))


def kept_patches(sample_index: torch.Tensor, seed: int, step: int, num_patches: int, prob: float) -> torch.Tensor:
    """``(B, K)`` indices (ascending) of the patches each sample keeps at optimizer ``step``: the ``K``
    (:func:`keep_count`) with the smallest hash of (``seed``, ``step``, the sample's global index, the patch)."""
    k = keep_count(num_patches, prob)
    if k == num_patches:  # nothing dropped: no draw
        return torch.arange(num_patches).expand(len(sample_index), -1).clone()
    with np.errstate(over="ignore"):
        base = _mix(_mix(np.array([seed], dtype=np.int64).view(np.uint64)) ^ np.uint64(step))
        per_sample = _mix(base ^ sample_index.numpy().astype(np.int64).view(np.uint64))
        noise = _mix(per_sample[:, None] ^ _mix(np.arange(num_patches, dtype=np.uint64))[None, :])
    keep = np.argpartition(noise, k - 1, axis=1)[:, :k]
    return torch.from_numpy(np.sort(keep, axis=1).astype(np.int64))


@dataclass(frozen=True)
class PatchDraw:
    """The run's patch dropout: ``prob`` of the tower's ``num_patches`` dropped, drawn from ``seed``."""

    prob: float
    num_patches: int
    seed: int

    @classmethod
    def of(cls, visual: nn.Module, prob: float, seed: int) -> PatchDraw | None:
        return cls(prob, num_patches(visual), seed) if prob > 0 else None

    def keep(self, sample_index: torch.Tensor | None, step: int) -> torch.Tensor:
        if sample_index is None:
            raise ValueError("model.patch_dropout draws each sample's mask from its global index, which this "
                             "batch does not carry")
        return kept_patches(sample_index, self.seed, step, self.num_patches, self.prob)


class KeptPatches(nn.Module):
    """The tower's patch-dropout slot: with ``keep (B, K)`` set, the class token and the kept patches of
    ``x (B, 1 + N, D)``; without, ``x`` unchanged."""

    def __init__(self):
        super().__init__()
        self.keep: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.keep is None:
            return x
        idx = (self.keep.to(x.device) + 1)[..., None].expand(-1, -1, x.shape[-1])
        return torch.cat([x[:, :1], x.gather(1, idx)], dim=1)


def can_drop(visual: nn.Module) -> bool:
    """Whether the image tower has patch tokens to drop (open_clip's ViT)."""
    return isinstance(visual, VisionTransformer)


def num_patches(visual: nn.Module) -> int:
    return visual.grid_size[0] * visual.grid_size[1]


def install(visual: nn.Module, arch: str | None = None) -> None:
    """Put :class:`KeptPatches` in the ViT's ``patch_dropout`` slot; a tower without patch tokens is refused."""
    if not can_drop(visual):
        raise ValueError(f"model.patch_dropout: the image tower of model.arch={arch} is {type(visual).__name__}, which "
                         "has no patch tokens to drop: use an open_clip ViT arch or set model.patch_dropout=0")
    visual.patch_dropout = KeptPatches()


@contextmanager
def dropping(visual: nn.Module, keep: torch.Tensor | None):
    """Within the block the tower keeps only ``keep``'s patches (None: all of them)."""
    slot = getattr(visual, "patch_dropout", None)
    if keep is None:
        yield
        return
    if not isinstance(slot, KeptPatches):
        raise ValueError("patch indices were given for a tower without model.patch_dropout installed")
    slot.keep = keep
    try:
        yield
    finally:
        slot.keep = None
