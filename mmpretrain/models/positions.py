"""A ViT's position embeddings on another grid, by open_clip's rule (:func:`open_clip.model.resize_pos_embed`:
the class token's row kept, the square grid interpolated bicubically with antialiasing): what
``train.phases`` does at a change of image size, and what loading a boundary checkpoint into a model of the
next phase's size does."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from open_clip.model import resize_pos_embed

__all__ = ["fit_positions", "grid_text", "resize_positions"]


def resize_positions(pos: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``pos`` (1 + g*g, D) to ``num_tokens`` = 1 + G*G rows by open_clip's ``resize_pos_embed``."""
    grid = math.isqrt(num_tokens - 1)
    state = {"visual.positional_embedding": pos}
    resize_pos_embed(state, SimpleNamespace(visual=SimpleNamespace(grid_size=(grid, grid))))
    return state["visual.positional_embedding"]


def fit_positions(pos: torch.Tensor, rows: int) -> torch.Tensor:
    """``pos`` itself when it has ``rows`` rows, else resized to them (in fp32, back in its dtype)."""
    if pos.shape[0] == rows:
        return pos
    return resize_positions(pos.float(), rows).to(pos.dtype)


def grid_text(rows: int) -> str:
    """``"GxG"`` of a (1 + G*G)-row table."""
    g = math.isqrt(rows - 1)
    return f"{g}x{g}"
