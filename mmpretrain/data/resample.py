"""Crop boxes of many decoded images and resize them to one size with Pillow's filters, in a constant
number of tensor operations per batch (``data.decode=device``).

Pillow resizes separably: for each output column a row of weights over the input columns (the filter,
scaled by the reduction factor when shrinking, centred on the output pixel, normalised to sum 1), the
horizontal pass rounded to 8 bits, then the same down the rows. Those weights are a matrix per image
and direction, so a batch's crops are two batched matrix products over the images padded to the
batch's largest:

    out[k] = Wy[k] @ round(image[k] @ Wx[k]^T)        Wy[k]: (H_out, H_max), Wx[k]: (W_out, W_max)

with each matrix zero outside its image's box, which makes the crop part of the resize. The weights are
built for the whole batch at once on the device from the boxes; no Python runs per image. Compared
with Pillow's fixed-point arithmetic on the worker path, the float products differ by at most a grey
level in a few pixels (tests/test_device_decode.py states the tolerance).

Memory, per chunk of N images padded to H_max x W_max: N * 3 * H_max * W_max bytes (uint8) + 4x that
(float) + N * 3 * H_max * W_out * 4 (the horizontal pass): at N = 256 images of about 400 x 400 padded
to 512 x 512, 0.2 + 0.8 + 0.35 GB, transient.
"""

from __future__ import annotations

import math

import torch
from PIL import Image

# Pillow's filters (libImaging/Resample.c): support radius and kernel, as functions of a tensor
_PI = math.pi


def _box(t):
    return ((t > -0.5) & (t <= 0.5)).to(t.dtype)


def _bilinear(t):
    return (1 - t.abs()).clamp_(min=0)


def _hamming(t):
    a = t.abs()
    return torch.sinc(a) * (0.54 + 0.46 * torch.cos(a * _PI)) * (a < 1)


def _bicubic(t):  # a = -0.5, as Pillow
    a, x = -0.5, t.abs()
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return torch.where(x < 1, near, torch.where(x < 2, far, torch.zeros_like(x)))


def _lanczos(t):
    return torch.where((t >= -3) & (t < 3), torch.sinc(t) * torch.sinc(t / 3), torch.zeros_like(t))


FILTERS = {Image.BOX: _box, Image.BILINEAR: _bilinear, Image.HAMMING: _hamming, Image.BICUBIC: _bicubic,
           Image.LANCZOS: _lanczos}


def weights(start: torch.Tensor, length: torch.Tensor, out: int, size: int, interpolation: int) -> torch.Tensor:
    """``(N, out, size)`` float32 (computed in float64): row ``i`` of image ``k`` weighs the input pixels ``start[k] ..
    start[k] + length[k]`` (its box, in one direction) for output pixel ``i`` as Pillow's resize of that
    crop does; zero elsewhere. ``start``, ``length``: (N,) on the device."""
    device = start.device
    f64 = torch.float64  # as Pillow computes them: a tap at exactly half a pixel falls on the same side
    start, length = start.to(f64), length.to(f64)
    scale = length / out  # input pixels per output pixel
    centre = (torch.arange(out, device=device, dtype=f64) + 0.5)[None, :] * scale[:, None]  # (N, out)
    x = torch.arange(size, device=device, dtype=f64)[None, None, :] - start[:, None, None]  # (N, 1, size)
    inside = (x >= 0) & (x < length[:, None, None])
    if interpolation == Image.NEAREST:  # Pillow's nearest: the pixel under the output pixel's centre
        return ((x == centre[:, :, None].floor()) & inside).to(torch.float32)
    kernel = FILTERS.get(interpolation)
    if kernel is None:
        raise ValueError(f"no device resampling for Pillow filter {interpolation}")
    stretch = scale.clamp(min=1)[:, None, None]  # Pillow widens the filter by the reduction factor
    w = kernel((x + 0.5 - centre[:, :, None]) / stretch) * inside
    return (w / w.sum(-1, keepdim=True).clamp(min=1e-12)).to(torch.float32)


def pad(images: list[torch.Tensor]) -> torch.Tensor:
    """``(N, 3, H_max, W_max)`` uint8 from N ``(3, h, w)`` images (zeros outside each), in two operator
    calls whatever N (a nested tensor and its padded form)."""
    import warnings

    with warnings.catch_warnings():  # "nested tensors are a prototype": the strided layout is all we use
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.as_nested_tensor(images).to_padded_tensor(0)


def crop_resize(padded: torch.Tensor, boxes: torch.Tensor, size: tuple[int, int], interpolation: int) -> torch.Tensor:
    """``(N, 3, out_h, out_w)`` float32 pixel values (0-255, integral as Pillow's): box ``k`` = (top, left,
    height, width) of ``padded[k]`` resized to ``size`` = (out_h, out_w)."""
    out_h, out_w = size
    boxes = boxes.to(padded.device)
    wy = weights(boxes[:, 0], boxes[:, 2], out_h, padded.shape[-2], interpolation)  # (N, out_h, H)
    wx = weights(boxes[:, 1], boxes[:, 3], out_w, padded.shape[-1], interpolation)  # (N, out_w, W)
    rows = torch.matmul(padded.to(torch.float32), wx.transpose(1, 2).unsqueeze(1))  # (N, 3, H, out_w)
    rows = rows.round_().clamp_(0, 255)  # Pillow's 8-bit intermediate
    return torch.matmul(wy.unsqueeze(1), rows).round_().clamp_(0, 255)
