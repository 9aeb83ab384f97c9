"""NaFlex inputs (SigLIP 2's variable resolution at native aspect ratio): an image becomes a sequence of
patches of any length, padded to the batch's sequence length with a validity mask.

An image of ``H x W`` pixels for a sequence length ``L`` and patch size ``P`` is resized, keeping its aspect
ratio, to the largest grid of ``gh x gw <= L`` patches that the rule of transformers' ``Siglip2ImageProcessor``
gives (:func:`grid_for`, the same sizes, so the exported model sees at inference what it trained on), with
Pillow's bilinear filter (the processor's), and cut into ``gh * gw`` patches in row-major order, each
flattened ``(P, P, 3)`` with the channel fastest (timm's ``NaFlexVit`` and the processor's layout). The
sequence is padded with zero patches to ``L``; ``patch_coord (L, 2)`` holds each patch's ``(row, column)``
and ``patch_valid (L,)`` which are real. Patches stay uint8 through the loader (a quarter of the bytes of
float) and are normalised on the device (:func:`normalize_patches`).

**Token budget.** ``data.naflex.max_tokens_per_batch`` per rank: a step at length ``L`` holds
``max_tokens_per_batch // L`` samples on each rank (a shorter sequence, a larger batch); every rank takes
the same length at the same step (the contrastive batch is global), from :func:`step_lengths`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import torch
from PIL import Image


def grid_for(height: int, width: int, patch_size: int, max_patches: int, eps: float = 1e-5) -> tuple[int, int]:
    """``(rows, columns)`` of patches for an image of ``height x width`` pixels: the largest scale whose
    sides, each rounded up to whole patches (at least one), give at most ``max_patches`` patches.
    The rule (a bisection on the scale to ``eps``) of transformers' ``get_image_size_for_max_num_patches``,
    so that the export's image processor sizes every image as training did."""
    def side(scale: float, size: int) -> int:
        return max(patch_size, math.ceil(size * scale / patch_size) * patch_size)

    lo, hi = eps / 10, 100.0
    while hi - lo >= eps:
        mid = (lo + hi) / 2
        if (side(mid, height) / patch_size) * (side(mid, width) / patch_size) <= max_patches:
            lo = mid
        else:
            hi = mid
    return side(lo, height) // patch_size, side(lo, width) // patch_size


def patchify(image: torch.Tensor, patch_size: int) -> torch.Tensor:
    """``image (C, gh*P, gw*P)`` -> ``(gh*gw, P*P*C)``: row-major patches, each flattened ``(P, P, C)``."""
    c, h, w = image.shape
    gh, gw = h // patch_size, w // patch_size
    return (image.reshape(c, gh, patch_size, gw, patch_size).permute(1, 3, 2, 4, 0)
            .reshape(gh * gw, patch_size * patch_size * c))


def resize_to_grid(img: Image.Image, seq_len: int, patch_size: int) -> Image.Image:
    """``img`` (RGB) resized to :func:`grid_for`'s grid for ``seq_len`` patches, bilinear."""
    gh, gw = grid_for(img.height, img.width, patch_size, seq_len)
    size = (gw * patch_size, gh * patch_size)
    return img if img.size == size else img.resize(size, Image.BILINEAR)


def image_patches(img: Image.Image, seq_len: int, patch_size: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """One image's uint8 patches ``(gh*gw, P*P*3)`` for ``seq_len`` and its grid ``(gh, gw)``."""
    resized = resize_to_grid(img, seq_len, patch_size)
    pixels = torch.frombuffer(bytearray(resized.tobytes()), dtype=torch.uint8)
    pixels = pixels.reshape(resized.height, resized.width, 3).permute(2, 0, 1)
    return patchify(pixels, patch_size), (resized.height // patch_size, resized.width // patch_size)


def pack(patches: Sequence[torch.Tensor], grids: Sequence[tuple[int, int]], seq_len: int,
         out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(patches (B, L, D), patch_coord (B, L, 2) long, patch_valid (B, L) bool)`` of per-image patch
    sequences padded with zeros to ``L = seq_len``. ``out``: a ``(B, L, D)`` tensor to write the patches
    into (shared memory in a loader worker)."""
    n, dim = len(patches), patches[0].shape[1]
    if out is None:
        out = torch.zeros(n, seq_len, dim, dtype=patches[0].dtype)
    else:
        out.zero_()
    coord = torch.zeros(n, seq_len, 2, dtype=torch.long)
    valid = torch.zeros(n, seq_len, dtype=torch.bool)
    for i, (p, (gh, gw)) in enumerate(zip(patches, grids)):
        k = gh * gw
        if k > seq_len or p.shape[0] != k:
            raise ValueError(f"image {i}: a {gh}x{gw} grid ({p.shape[0]} patches) does not fit {seq_len}")
        out[i, :k] = p
        rows = torch.arange(gh).repeat_interleave(gw)
        coord[i, :k, 0], coord[i, :k, 1] = rows, torch.arange(gw).repeat(gh)
        valid[i, :k] = True
    return out, coord, valid


# The attribute a device ``patch_coord`` carries: its samples' grids, read on the host before the copy, so
# that the tower's per-grid position tables need no read back from the device (models/naflex.py)
GRIDS = "_mmpt_naflex_grids"


def grids_of(patch_coord: torch.Tensor) -> list[tuple[int, int]]:
    """Each sample's patch grid ``(rows, cols)`` from its ``(B, L, 2)`` coordinates: the largest row and
    column + 1 (padding sits at (0, 0)), as timm's ``calculate_naflex_grid_sizes`` computes it. One read of a
    ``(B, 2)`` tensor: free on the host, one copy from a device."""
    return [(int(h), int(w)) for h, w in (patch_coord.amax(dim=1) + 1).tolist()]


def host_grids(patch_coord: torch.Tensor) -> list[tuple[int, int]] | None:
    """:func:`grids_of` the loader's coordinates while they are on the host; None on a device (reading
    them there would wait for it: the tower then reads them once itself)."""
    return grids_of(patch_coord) if patch_coord.device.type == "cpu" else None


def with_grids(patch_coord: torch.Tensor, grids: list[tuple[int, int]] | None) -> torch.Tensor:
    """``patch_coord`` carrying ``grids`` (:data:`GRIDS`; None: as it is)."""
    if grids is not None:
        setattr(patch_coord, GRIDS, grids)
    return patch_coord


def patch_rows(inputs: dict[str, torch.Tensor], rows: slice) -> dict[str, torch.Tensor]:
    """Rows ``rows`` of a NaFlex image dict (patches, coordinates, mask), the grids they carry kept."""
    out = {k: v[rows] for k, v in inputs.items()}
    grids = getattr(inputs["patch_coord"], GRIDS, None)
    with_grids(out["patch_coord"], None if grids is None else grids[rows])
    return out


def normalize_patches(patches: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """uint8 ``(B, L, P*P*C)`` patches (channel fastest) -> float32 ``(x / 255 - mean) / std`` per channel,
    the same operations in the same order as the square path's normalisation."""
    b, n, d = patches.shape
    c = mean.numel()
    x = patches.to(torch.float32).reshape(b, n, d // c, c).div(255)
    return x.sub_(mean.reshape(c).to(x.device)).div_(std.reshape(c).to(x.device)).reshape(b, n, d)


def batch_sizes(seq_lens: Sequence[int], max_tokens: int) -> list[int]:
    """Samples per rank at each sequence length under a budget of ``max_tokens`` patches per rank."""
    return [max_tokens // n for n in seq_lens]


def step_lengths(seq_lens: Sequence[int], seed: int, epoch: int, steps: int) -> list[int]:
    """The sequence length of each of an epoch's ``steps`` steps (indices into ``seq_lens``): in cycles of
    ``len(seq_lens)`` steps, each length once per cycle in an order seeded by ``(seed, epoch, cycle)``
    (uniform draws, stratified: every length gets its share of the steps); a last, partial cycle takes the
    lengths in their configured order. The same on every rank and under resume."""
    k = len(seq_lens)
    out: list[int] = []
    for cycle in range(steps // k):
        order = list(range(k))
        random.Random(f"{seed}:{epoch}:naflex:{cycle}").shuffle(order)
        out.extend(order)
    out.extend(range(steps - len(out)))
    return out


def steps_per_epoch(seq_lens: Sequence[int], max_tokens: int, samples: int, world_size: int) -> int:
    """Steps an epoch of ``samples`` takes on ``world_size`` ranks: whole cycles while they fit, then the
    longest prefix of a cycle (lengths in their configured order) that still does."""
    sizes = [b * world_size for b in batch_sizes(seq_lens, max_tokens)]
    cycles, left = divmod(samples, sum(sizes))
    steps = cycles * len(sizes)
    for size in sizes:
        if size > left:
            break
        left -= size
        steps += 1
    return steps


class NaFlexPreprocess:
    """The evaluation transform of a NaFlex model at ``seq_len`` patches: a PIL image -> one float tensor
    ``(seq_len, P*P*3 + 3)``, the normalised patches then each patch's row, column and validity, so that
    the evaluation's batching, rank split and gather stack it as any image tensor
    (:func:`unpack_patches` takes it apart; :class:`mmpretrain.models.naflex.NaFlexInputs` does)."""

    def __init__(self, seq_len: int, patch_size: int, mean, std):
        self.seq_len, self.patch_size = seq_len, patch_size
        self.mean, self.std = torch.as_tensor(mean, dtype=torch.float32), torch.as_tensor(std, dtype=torch.float32)

    def __call__(self, img: Image.Image) -> torch.Tensor:
        patches, grid = image_patches(img.convert("RGB"), self.seq_len, self.patch_size)
        p, coord, valid = pack([patches], [grid], self.seq_len)
        x = normalize_patches(p, self.mean, self.std)[0]
        return torch.cat([x, coord[0].float(), valid[0, :, None].float()], dim=1)


def unpack_patches(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """:class:`NaFlexPreprocess`'s stacked tensors ``(B, L, D + 3)`` -> the NaFlexVit tower's input dict."""
    return {"patches": x[..., :-3], "patch_coord": x[..., -3:-1].round().long(), "patch_valid": x[..., -1] > 0.5}
