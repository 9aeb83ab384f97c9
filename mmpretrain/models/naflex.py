"""The NaFlex image tower: timm's ``NaFlexVit`` as open_clip's timm trunk (``vision_cfg.timm_model_name``,
``timm_pool: map``, ``timm_proj: none``: the attention-pooled output is the image feature, SigLIP's
layout). It takes a dict ``{"patches": (B, L, P*P*3), "patch_coord": (B, L, 2), "patch_valid": (B, L)}``
(:mod:`mmpretrain.data.naflex`), which open_clip's ``TimmModel`` hands to the trunk unchanged.

``mmpt_naflexvit_tiny`` is the packaged CPU size (patch 8, width 64, 2 blocks, a 4x4 learned position
table resized to each image's grid): timm's ``naflexvit_base_patch16_siglip`` recipe, shrunk.
"""

from __future__ import annotations

import timm
from timm.models import register_model
from torch import nn

TINY = {"patch_size": 8, "embed_dim": 64, "depth": 2, "num_heads": 2, "pos_embed_grid_size": (4, 4)}


def _tiny(pretrained: bool = False, **kwargs) -> nn.Module:
    if pretrained:
        raise ValueError("mmpt_naflexvit_tiny has no pretrained weights")
    return timm.create_model("naflexvit_base_patch16_siglip", pretrained=False, **{**TINY, **kwargs})


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
