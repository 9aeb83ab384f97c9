"""The NaFlex image tower: timm's ``NaFlexVit`` as open_clip's timm trunk (``vision_cfg.timm_model_name``,
``timm_pool: map``, ``timm_proj: none``: the attention-pooled output is the image feature, SigLIP's
layout). It takes a dict ``{"patches": (B, L, P*P*3), "patch_coord": (B, L, 2), "patch_valid": (B, L)}``
(:mod:`mmpretrain.data.naflex`), which open_clip's ``TimmModel`` hands to the trunk unchanged.

``mmpt_naflexvit_tiny`` is the packaged CPU size (patch 8, width 64, 2 blocks, a 4x4 learned position
table resized to each image's grid): timm's ``naflexvit_base_patch16_siglip`` recipe, shrunk.

timm 1.0.31 finds each sample's grid for its position table with 2 ``.item()`` calls per sample
(``calculate_naflex_grid_sizes``): 2B host waits per forward on a GPU. :func:`grid_sizes` replaces it, with
the same result: the grids the loader read on the host (:data:`mmpretrain.data.naflex.GRIDS`), else one copy
of the ``(B, 2)`` maxima.
"""

from __future__ import annotations

import timm
import torch
from timm.models import naflexvit, register_model
from torch import nn

from mmpretrain.data.naflex import GRIDS, NaFlexPreprocess, grids_of, unpack_patches

TINY = {"patch_size": 8, "embed_dim": 64, "depth": 2, "num_heads": 2, "pos_embed_grid_size": (4, 4)}


def _tiny(pretrained: bool = False, **kwargs) -> nn.Module:
    if pretrained:
        raise ValueError("mmpt_naflexvit_tiny has no pretrained weights")
    return timm.create_model("naflexvit_base_patch16_siglip", pretrained=False, **{**TINY, **kwargs})


def grid_sizes(patch_coord: torch.Tensor) -> list[tuple[int, int]]:
    """timm's ``calculate_naflex_grid_sizes`` without a host wait per sample: the grids ``patch_coord``
    carries when they match its rows, else :func:`~mmpretrain.data.naflex.grids_of` (one read)."""
    grids = getattr(patch_coord, GRIDS, None)
    return grids if grids is not None and len(grids) == patch_coord.shape[0] else grids_of(patch_coord)


# timm's own (the benchmark's reference); replaced, as it is looked up by name at each call in every NaFlexVit
timm_grid_sizes = getattr(naflexvit, "calculate_naflex_grid_sizes", None)
if timm_grid_sizes is not None and timm_grid_sizes is not grid_sizes:
    naflexvit.calculate_naflex_grid_sizes = grid_sizes

_tiny.__name__ = "mmpt_naflexvit_tiny"
if "mmpt_naflexvit_tiny" not in timm.list_models("mmpt_*"):
    register_model(_tiny)


def is_naflex(model_cfg: dict) -> bool:
    """Whether a model config's image tower is a NaFlexVit (takes patch sequences)."""
    return "naflexvit" in str(model_cfg.get("vision_cfg", {}).get("timm_model_name", ""))


def naflex_geometry(visual: nn.Module) -> tuple[int, int]:
    """``(patch_size, position table side)`` of a built NaFlex image tower (open_clip's ``TimmModel``)."""
    embeds = visual.trunk.embeds
    p = embeds.patch_size
    return (p[0] if isinstance(p, (tuple, list)) else int(p)), int(embeds.pos_embed.shape[1])


def is_naflex_tower(visual: nn.Module) -> bool:
    """Whether a built image tower is a NaFlexVit trunk (it takes patch sequences)."""
    return type(getattr(visual, "trunk", None)).__name__ == "NaFlexVit"


class NaFlexInputs:
    """A NaFlex model for the evaluation and :func:`mmpretrain.load`: ``encode_image`` takes the stacked
    tensors of :class:`~mmpretrain.data.naflex.NaFlexPreprocess` (or the tower's dict as is); everything
    else is the open_clip model's."""

    def __init__(self, clip: nn.Module):
        self.clip = clip

    def __getattr__(self, name):
        return getattr(self.clip, name)

    def encode_image(self, images, normalize: bool = False):
        x = images if isinstance(images, dict) else unpack_patches(images)
        return self.clip.encode_image(x, normalize=normalize)

    def eval(self) -> NaFlexInputs:
        self.clip.eval()
        return self

    def train(self, mode: bool = True) -> NaFlexInputs:
        self.clip.train(mode)
        return self

    def to(self, *args, **kwargs) -> NaFlexInputs:
        self.clip.to(*args, **kwargs)
        return self


def wrapped(clip: nn.Module):
    """A NaFlex model as the evaluation takes it (:class:`NaFlexInputs`), any other as it is."""
    return NaFlexInputs(clip) if is_naflex_tower(clip.visual) else clip


def for_eval(clip: nn.Module, preprocess_cfg: dict, seq_len: int | None = None):
    """``(model, preprocess)`` for the evaluation: a NaFlex model wrapped with its transform at ``seq_len``
    patches (default: its position table's, the length it is sized for); any other model as it is (None)."""
    if not is_naflex_tower(clip.visual):
        return clip, None
    patch, side = naflex_geometry(clip.visual)
    return NaFlexInputs(clip), NaFlexPreprocess(seq_len or side * side, patch, preprocess_cfg["mean"],
                                                preprocess_cfg["std"])
