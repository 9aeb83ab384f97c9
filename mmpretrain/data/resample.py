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

The boxes are first gathered out of the padded images (two gathers), so the products run over the
chunk's largest box, not its largest image. Memory, per chunk of N images padded to H x W with boxes
at most h x w: N * 3 * (H * W + h * W + h * w) bytes (uint8) + N * 3 * h * w * 4 (float) + N * 3 * h *
W_out * 4 (the horizontal pass); compute N * 3 * h * w * (W_out + H_out) * 2 flops (scripts/bench/
bench_device_step.py prints both for photos at 224 px).
"""

from __future__ import annotations

import math
import warnings

import torch
from PIL import Image

from mmpretrain.data.transfer import to_device

# once, at import (never per call on the decoding thread: see device_decode.py): nested tensors are "a
# prototype", and only their padded strided form is used here
warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors", category=UserWarning)

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
    return torch.nested.as_nested_tensor(images).to_padded_tensor(0)


def crops(padded: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
    """``(N, 3, h_max, w_max)``: box ``k`` of ``padded[k]`` at the top left (the rest repeats its last
    row and column; the weights give it zero), by two gathers. ``boxes``: (N, 4) on the host (their
    largest height and width are read there: no device sync)."""
    h_max, w_max = (int(v) for v in boxes[:, 2:].max(0).values.tolist())
    N, C, H, W = padded.shape
    b = to_device(boxes, padded.device)
    rows = (b[:, 0:1] + torch.arange(h_max, device=padded.device)).clamp_(max=H - 1)  # (N, h_max)
    cols = (b[:, 1:2] + torch.arange(w_max, device=padded.device)).clamp_(max=W - 1)  # (N, w_max)
    x = padded.gather(2, rows[:, None, :, None].expand(N, C, h_max, W))
    return x.gather(3, cols[:, None, None, :].expand(N, C, h_max, w_max))


def crop_resize(padded: torch.Tensor, boxes: torch.Tensor, size: tuple[int, int], interpolation: int) -> torch.Tensor:
    """``(N, 3, out_h, out_w)`` float32 pixel values (0-255, integral as Pillow's): box ``k`` = (top, left,
    height, width; a host tensor) of ``padded[k]`` resized to ``size`` = (out_h, out_w). The boxes are
    gathered first (:func:`crops`), so the products cost N * 3 * h_max * w_max * (out_w + out_h) * 2."""
    out_h, out_w = size
    x = crops(padded, boxes)
    zero = torch.zeros(len(boxes), device=padded.device)
    b = to_device(boxes, padded.device)
    wy = weights(zero, b[:, 2], out_h, x.shape[-2], interpolation)  # (N, out_h, h_max)
    wx = weights(zero, b[:, 3], out_w, x.shape[-1], interpolation)  # (N, out_w, w_max)
    rows = _exact_matmul(x.to(torch.float32), wx.transpose(1, 2).unsqueeze(1), weights_right=True)  # (N, 3, h_max, out_w)
    rows = rows.round_().clamp_(0, 255)  # Pillow's 8-bit intermediate
    return _exact_matmul(wy.unsqueeze(1), rows, weights_right=False).round_().clamp_(0, 255)


def _exact_matmul(a: torch.Tensor, b: torch.Tensor, weights_right: bool) -> torch.Tensor:
    """``a @ b`` for 8-bit pixel values and float32 filter weights, exact to float32 whether or not TF32
    is on. The trainer turns TF32 on on a GPU, and a TF32 product keeps 10 bits of each weight's mantissa
    (~5e-4 relative: a pixel off by a grey level). The weights are split into a part that TF32 holds
    exactly (their top 10 mantissa bits) and the rest, so ``a @ hi + a @ lo`` loses only the rest's
    rounding (~2^-21 of a weight); the pixels, integers up to 255, are exact in TF32 already."""
    w = b if weights_right else a
    hi = (w.view(torch.int32) & -8192).view(torch.float32)  # -8192 = ~0x1FFF: the low 13 mantissa bits cleared
    lo = w - hi
    if weights_right:
        return torch.matmul(a, hi) + torch.matmul(a, lo)
    return torch.matmul(hi, b) + torch.matmul(lo, b)
