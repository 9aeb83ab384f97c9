"""The training task: what one step feeds the model and the objective, read off the objective's
declarations (:data:`mmpretrain.losses.base.NEEDS`) and the typed batch (:mod:`mmpretrain.data.batch`).

The trainer has no branch on an objective's name or on a single need's batch field: a need served by batch
fields reaches the objective's forward as those fields, by name (:meth:`Batch.for_needs`); the task adds
what the model or the run provides (the text pass over hard-negative captions, the image encodings, the
teachers' widths, caption embeddings computed online).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mmpretrain.config import ConfigError
from mmpretrain.data.batch import Batch
from mmpretrain.data.decode import DeviceNormalize
from mmpretrain.data.image_input import ImageInput
from mmpretrain.data.transfer import cut_on_device, to_device
from mmpretrain.losses.base import NEEDS
from mmpretrain.models.patch_dropout import PatchDraw
from mmpretrain.models.ssl import SslInputs, Teacher, masked_patches
from mmpretrain.models.text import padded_length


@dataclass
class StepInputs:
    """One step's inputs on the device: the model's (``images (B, 3, H, W)``, ``tokens (B, L)``,
    ``target_embeddings (B, E)``, ``negative_tokens (B, L)``, whether it returns ``image_encodings``, and
    ``caption_logits`` with ``caption``) and
    ``context``, the objective's keywords besides the features (``step``, ``epoch`` and its needs)."""

    images: torch.Tensor
    tokens: torch.Tensor | None = None
    target_embeddings: torch.Tensor | None = None
    negative_tokens: torch.Tensor | None = None
    encodings: bool = False
    context: dict[str, Any] = field(default_factory=dict)
    patch_keep: torch.Tensor | None = None
    caption: bool = False
    ssl: SslInputs | None = None

    @property
    def model_kw(self) -> dict[str, Any]:
        """The model's keywords besides images, tokens and targets, those in use only: what ``forward_backward``
        hands the model (tensors sliced with its micro-batches)."""
        kw = {"negative_tokens": self.negative_tokens, "encodings": self.encodings, "patch_keep": self.patch_keep,
              "caption": self.caption, "ssl": self.ssl}
        return {k: v for k, v in kw.items() if v is not None and v is not False}


@dataclass
class TrainingTask:
    """``objective``: the run's; ``images``: its image input; ``target_encoder``: the sentence-transformer
    with ``targets.source=online``; ``trim_text``: drop the batch's trailing padding before the text tower
    (to a multiple of ``text_length_multiple``); ``teacher_dims``: each stored teacher's width; ``ema``:
    the weights' average (``encodings = "ema"``); ``patch_dropout``: the run's patch draw (None: off)."""

    objective: Any
    images: ImageInput = field(default_factory=ImageInput)
    target_encoder: Any = None
    trim_text: bool = False
    text_length_multiple: int = 8
    teacher_dims: list[int] | None = None
    ema: Any = None
    patch_dropout: PatchDraw | None = None
    seed: int = 0
    _local_normalize: DeviceNormalize | None = field(default=None, repr=False)

    def __post_init__(self):
        unknown = sorted(set(self.objective.needs) - NEEDS.keys())
        if unknown:
            raise ValueError(f"the objective needs {unknown}, which nothing provides; known needs: {sorted(NEEDS)}")
        if "self_distill" not in self.objective.needs:
            return
        norm = self.images.normalize
        if norm is None:
            raise ConfigError("loss self_distill normalises its local crops as the model's images are, on the device, "
                              "which this data.aug_cfg's transform (normalised in the loader) does not offer: keep "
                              "open_clip's own augmentation (drop use_timm)")
        # the model's normalisation for the (N, h, w, 3) local crops, read while the statistics are on the host
        self._local_normalize = DeviceNormalize(norm.mean.cpu().flatten().tolist(), norm.std.cpu().flatten().tolist(), True)

    @property
    def needs(self) -> frozenset[str]:
        return frozenset(self.objective.needs)

    def inputs(self, batch: Batch, step: int, accelerator, model) -> StepInputs:
        """The step's inputs from ``batch`` (``batch.epoch``: its 0-based stream epoch) at optimizer step
        ``step``; ``model``: the prepared model (its image tower's average, for ``encodings = "ema"``)."""
        device = accelerator.device
        images = self.images(batch, device)
        target = batch.target_embeddings
        if self.target_encoder is not None:
            with torch.no_grad():
                target = self.target_encoder.encode(batch.texts, convert_to_tensor=True, normalize_embeddings=True)
        if target is not None:
            target = to_device(target, device).float()
        tokens, negative_tokens = self._tokens(batch, device)
        context: dict[str, Any] = {"step": step, "epoch": int(batch.epoch) + 1}
        context.update({k: to_device(v, device) for k, v in batch.for_needs(self.needs).items()})
        if "teacher" in self.needs:
            context["teacher_dims"] = self.teacher_dims
        encodings = self.objective.encodings if "image_encodings" in self.needs else None
        if encodings == "ema":  # ReSA's momentum encoder: the weight average's image tower, no gradient
            with accelerator.autocast():
                context["image_encodings"] = self.ema.encodings(accelerator.unwrap_model(model), images)
        keep = None
        if self.patch_dropout is not None:  # drawn on the host from the sample's index: no device RNG, no sync
            keep = self.patch_dropout.keep(batch.sample_index, step)
            keep = to_device(keep, device)
        ssl = self._self_supervised(batch, step, accelerator, model, images, context)
        return StepInputs(images, tokens, target, negative_tokens, encodings == "online", context, keep,
                          "caption" in self.needs, ssl)

    def _self_supervised(self, batch: Batch, step: int, accelerator, model, images, context) -> SslInputs | None:
        """``self_distill`` / ``masked_prediction`` past their start: the student's local crops and mask (drawn on
        the host from the sample's index), and the teacher's outputs (the ``train.ema`` average, no gradient)
        into ``context``."""
        active = self.objective.ssl_active(step) if hasattr(self.objective, "ssl_active") else frozenset()
        if not active:
            return None
        device = accelerator.device
        local = None
        if "self_distill" in active:
            crops = to_device(batch.local_images, device)  # (B, n, h, w, 3) uint8
            local = self._local_normalize(crops.flatten(0, 1))
            if self.images.dtype is not None:
                local = local.to(self.images.dtype)
        index = None
        if "masked_prediction" in active:
            term = next(t for t in self.objective.terms if "masked_prediction" in t.needs)
            index = to_device(masked_patches(batch.sample_index, self.seed, step, term.num_patches, term.masked_count()),
                              device)
        unwrapped = accelerator.unwrap_model(model)
        with accelerator.autocast():
            context.update(self.ema.call(Teacher(unwrapped), images, "self_distill" in active, index))
        return SslInputs(local, 0 if local is None else batch.local_images.shape[1], index)

    def _tokens(self, batch: Batch, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The captions' tokens and, with ``negatives``, the negatives' (one text pass: both cut to the
        longer of the two), their used length read on the host copy (on the device it would be a sync)."""
        tokens = batch.tokens
        if tokens is None:
            return None, None
        negatives = batch.negative_tokens if "negatives" in self.needs else None
        length = tokens.shape[1]
        if self.trim_text:  # both cut to the longer of the two (one text pass)
            length = max(padded_length(t, self.text_length_multiple) for t in (tokens, negatives) if t is not None)
        # copied whole from the pinned batch and cut on the device: a host-side cut would copy from a
        # non-contiguous view, through pageable memory, which makes the stream wait for the host
        return (cut_on_device(tokens, length, device),
                None if negatives is None else cut_on_device(negatives, length, device))
