"""open_clip's training augmentation in one pass over the JPEG: the crop is drawn from the image's header
before any pixel is decoded, the JPEG is decoded at the largest DCT reduction that keeps the crop at
least the output size, and the crop is resized straight to a uint8 HWC array.

:class:`CropSampler` draws boxes with the distribution of torchvision's ``RandomResizedCrop.get_params``
(the same ten tries, the same rounding, the same centre-crop fallback), in plain Python from a
``random.Random`` seeded per sample: no torch op per try. Boxes are ``(top, left, height, width)`` in the
original image's pixels whatever the decode reduction, so a stored box replays the same crop.
:func:`fast_train_transform` recognises open_clip's training transform (``RandomResizedCrop`` +
``MaybeConvertMode`` + to-tensor, any ``scale``/``ratio``/size); any other transform (colour jitter,
grayscale, timm's) is kept and runs as torchvision's.
"""

from __future__ import annotations

import math
import random
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image

from mmpretrain.data.jpeg import check_tail

#: the DCT reductions libjpeg offers through Pillow's draft mode, largest first
DRAFT_SCALES = (8, 4, 2)


class Box(NamedTuple):
    top: int
    left: int
    height: int
    width: int


class CropSampler:
    """``RandomResizedCrop.get_params(img, scale, ratio)`` in distribution: up to ten tries of an area
    fraction ~ U(scale) and a log-uniform aspect ratio in ``ratio``, the first box that fits placed
    uniformly; else the centre crop clamped to ``ratio``."""

    def __init__(self, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
        if not (0 < scale[0] <= scale[1]) or not (0 < ratio[0] <= ratio[1]):
            raise ValueError(f"crop scale {tuple(scale)} and ratio {tuple(ratio)} must be positive, low <= high")
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))
        self._log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))

    def __call__(self, width: int, height: int, rng: random.Random) -> Box:
        area = height * width
        (s0, s1), (r0, r1) = self.scale, self._log_ratio
        for _ in range(10):
            target_area = area * rng.uniform(s0, s1)
            aspect = math.exp(rng.uniform(r0, r1))
            w = int(round(math.sqrt(target_area * aspect)))
            h = int(round(math.sqrt(target_area / aspect)))
            if 0 < w <= width and 0 < h <= height:
                return Box(rng.randrange(height - h + 1), rng.randrange(width - w + 1), h, w)
        in_ratio = width / height
        if in_ratio < self.ratio[0]:
            w, h = width, int(round(width / self.ratio[0]))
        elif in_ratio > self.ratio[1]:
            w, h = int(round(height * self.ratio[1])), height
        else:
            w, h = width, height
        return Box((height - h) // 2, (width - w) // 2, h, w)


class ResizedCrop:
    """Opened (not yet decoded) image + per-sample seed -> ``(H, W, 3)`` uint8 tensor, the crop drawn by
    :class:`CropSampler` and resized with ``interpolation`` to ``size`` = (height, width).

    Decoded at full size, the pixels are torchvision's ``resized_crop`` of the same box, bit for bit. A
    JPEG whose box is at least twice the output in both dimensions is decoded at a DCT reduction of 2,
    4 or 8 (the largest that keeps the box at least the output size) and the box resized from there."""

    channels_last = True  # the batch is (B, H, W, 3); DeviceNormalize permutes it on the device

    def __init__(self, size, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), interpolation=Image.BICUBIC,
                 draft: bool = True):
        self.size = (int(size), int(size)) if isinstance(size, int) else (int(size[0]), int(size[1]))
        self.sampler = CropSampler(scale, ratio)
        self.interpolation = interpolation
        self.draft = draft

    def box(self, img: Image.Image, seed: int) -> Box:
        return self.sampler(img.width, img.height, random.Random(seed))

    def reduction(self, img: Image.Image, box: Box) -> int:
        """The DCT reduction to decode ``img`` at for ``box`` (1: full size)."""
        return self.jpeg_reduction(box) if img.format == "JPEG" else 1

    def jpeg_reduction(self, box: Box) -> int:
        """The DCT reduction a JPEG is decoded at for ``box``: the largest of 8, 4, 2 that keeps the box at
        least the output size in both dimensions, else 1 (full size)."""
        if not self.draft:
            return 1
        out_h, out_w = self.size
        return next((s for s in DRAFT_SCALES if box[2] >= s * out_h and box[3] >= s * out_w), 1)

    def decode(self, img: Image.Image, box: Box, check=None) -> tuple[Image.Image, int]:
        """``img`` (as opened) decoded to RGB at the reduction ``box`` allows; ``(image, reduction)``.
        ``check``: called on the image about to be decoded (its size the reduced one), e.g. a pixel cap.
        Raises :class:`~mmpretrain.data.jpeg.TruncatedJpeg` for a JPEG whose data do not cover its frame."""
        s = self.reduction(img, box)
        (width, height), jpeg = img.size, img.format == "JPEG"
        if s > 1:
            drafted = img.draft("RGB", (img.width // s, img.height // s))
            s = img.decoderconfig[0] if drafted is not None else 1  # what libjpeg will actually do
        if check is not None:
            check(img)
        img.load()
        if jpeg:  # data that ran out before the last block decode to libjpeg's grey fill (jpeg.py)
            check_tail(img, height, width, s)
        return (img if img.mode == "RGB" else img.convert("RGB")), s

    def resize(self, img: Image.Image, box: Box, s: int) -> torch.Tensor:
        """``box`` (original pixels) of ``img`` decoded at reduction ``s``, resized to ``size``, (H, W, 3)."""
        out = (self.size[1], self.size[0])  # Pillow's (width, height)
        top, left, h, w = box
        if s == 1:  # torchvision's F.resized_crop on a PIL image: crop, then resize
            img = img.crop((left, top, left + w, top + h)).resize(out, self.interpolation)
        else:  # the box in the reduced image's pixels: original pixel x is at x / s there
            img = img.resize(out, self.interpolation, box=(left / s, top / s, (left + w) / s, (top + h) / s))
        return torch.from_numpy(np.asarray(img).copy())

    def apply(self, img: Image.Image, box: Box, check=None) -> torch.Tensor:
        """Decode ``img`` (as opened) and return ``box`` of it resized to ``size``."""
        decoded, s = self.decode(img, box, check)
        return self.resize(decoded, box, s)

    def __call__(self, img: Image.Image, seed: int, check=None) -> torch.Tensor:
        return self.apply(img, self.box(img, seed), check)


def fast_train_transform(transform, draft: bool = True) -> ResizedCrop | None:
    """A :class:`ResizedCrop` doing what ``transform`` does, when it is open_clip's training transform
    as :func:`mmpretrain.data.decode.split_normalize` leaves it (``RandomResizedCrop``, ``MaybeConvertMode``
    to RGB, ``PILToTensor``); None for any other transform."""
    from torchvision import transforms as T

    steps = list(getattr(transform, "transforms", []))
    if len(steps) != 3 or type(steps[0]) is not T.RandomResizedCrop or type(steps[2]) is not T.PILToTensor:
        return None
    rrc, convert = steps[0], steps[1]
    if type(convert).__name__ != "MaybeConvertMode" or getattr(convert, "mode", None) != "RGB":
        return None
    interpolation = {T.InterpolationMode.BICUBIC: Image.BICUBIC, T.InterpolationMode.BILINEAR: Image.BILINEAR,
                     T.InterpolationMode.NEAREST: Image.NEAREST, T.InterpolationMode.LANCZOS: Image.LANCZOS,
                     T.InterpolationMode.BOX: Image.BOX, T.InterpolationMode.HAMMING: Image.HAMMING}.get(
                         rrc.interpolation)
    if interpolation is None:
        return None
    return ResizedCrop(tuple(rrc.size), rrc.scale, rrc.ratio, interpolation, draft=draft)
