"""The objectives by their config name (``loss[].name``), except the wrappers: what ``regions`` (region
weighting around any one objective) may wrap. :data:`mmpretrain.losses.LOSSES` is this plus the
wrappers; a wrapper imports this module, and nothing here imports a wrapper."""

from __future__ import annotations

from mmpretrain.losses.align_uniform import AlignUniformLoss
from mmpretrain.losses.base import Objective
from mmpretrain.losses.clip import ClipLoss
from mmpretrain.losses.cwcl import CwclLoss
from mmpretrain.losses.distill import DistillLoss
from mmpretrain.losses.global_clip import GlobalClipLoss
from mmpretrain.losses.sigmoid import SigmoidLoss
from mmpretrain.losses.soft_target import SoftTargetLoss
from mmpretrain.losses.vrn import VrnLoss

OBJECTIVES: dict[str, type[Objective]] = {
    "clip": ClipLoss,
    "sigmoid": SigmoidLoss,
    "soft_target": SoftTargetLoss,
    "cwcl": CwclLoss,
    "vrn": VrnLoss,
    "align_uniform": AlignUniformLoss,
    "global_clip": GlobalClipLoss,
    "distill": DistillLoss,
}
