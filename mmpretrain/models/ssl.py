"""The model's side of ``self_distill`` and ``masked_prediction`` (:mod:`mmpretrain.losses.self_supervised`):
the DINO heads and the mask token (``DualEncoder.ssl``, trained and averaged by ``train.ema`` with the
towers, never exported), the student's forwards and the teacher's (the average's weights, no gradient).

- :class:`DinoHead`: DINO's head, a 3-layer MLP (GELU) to an L2-normalised bottleneck and cosine logits
  against ``out_dim`` prototypes (DINO's weight-normalised last layer with its gain fixed at 1).
- The student's local crops run the image tower at their own size, its position embeddings resized to their
  grid by open_clip's rule (:func:`~mmpretrain.models.positions.fit_positions`; the gradient reaches the
  table); the ``global`` head takes the pooled output before the projection.
- The student's masked view: the global view with ``M`` patch embeddings replaced by the mask token before
  the position embeddings are added (iBOT, TIPS); the ``patch`` head takes the output tokens at those
  positions (after ``ln_post``; a tower that pools by attention: the transformer's own tokens).
- The teacher: the same tower and heads under the average, on the unmasked global view.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mmpretrain.models.patch_dropout import _mix
from mmpretrain.models.positions import fit_positions

#: salts the patch-mask draw, so that a run with patch dropout and masking does not draw one set for both
MASK_SALT = 0x7F4A7C15


class DinoHead(nn.Module):
    def __init__(self, width: int, out_dim: int, hidden_dim: int, bottleneck_dim: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(width, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, hidden_dim), nn.GELU(),
                                 nn.Linear(hidden_dim, bottleneck_dim))
        self.prototypes = nn.Parameter(torch.empty(out_dim, bottleneck_dim))
        for m in self.mlp:
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)
        nn.init.trunc_normal_(self.prototypes, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = F.normalize(self.mlp(x), dim=-1)
        return z @ F.normalize(self.prototypes, dim=-1).to(z.dtype).T


class SelfSupervised(nn.Module):
    """``heads``: a :class:`DinoHead` per spec (``global`` on pooled features, ``patch`` on tokens);
    ``mask_token (width,)`` with a ``patch`` head (zeros at the start, as iBOT's)."""

    def __init__(self, visual: nn.Module, specs):
        super().__init__()
        widths = {"global": pooled_width(visual), "patch": visual.transformer.width}
        self.heads = nn.ModuleDict({s.name: DinoHead(widths[s.name], s.out_dim, s.hidden_dim, s.bottleneck_dim)
                                    for s in specs})
        self.mask_token = nn.Parameter(torch.zeros(visual.transformer.width)) if "patch" in self.heads else None

    def zero(self) -> torch.Tensor:
        """0, through every parameter here: added to the features at every step (a head whose term has not
        started, or a mask token without masked_prediction, is otherwise out of the graph), so that
        DDP sees a gradient (of 0) for each (its reducer stops at the second step on one without)."""
        return sum(p.reshape(-1)[0] for p in self.parameters()) * 0


def pooled_width(visual: nn.Module) -> int:
    proj = getattr(visual, "proj", None)
    return proj.shape[0] if isinstance(proj, torch.Tensor) else visual.output_dim


@dataclass
class SslInputs:
    """The student's extra inputs at one step: ``local (B * n, 3, h, w)`` normalised local crops (``n`` per
    sample, sample-major) or None; ``masked_index (B, M)`` the masked patches or None."""

    local: torch.Tensor | None = None
    count: int = 0
    masked_index: torch.Tensor | None = None

    def rows(self, s: slice) -> SslInputs:
        """A micro-batch's rows (``train.micro_batch_mode=accumulate``)."""
        local = None if self.local is None else self.local[s.start * self.count:s.stop * self.count]
        return SslInputs(local, self.count, None if self.masked_index is None else self.masked_index[s])


def masked_patches(sample_index: torch.Tensor, seed: int, step: int, num_patches: int, count: int) -> torch.Tensor:
    """``(B, count)`` patch indices (ascending) each sample masks at ``step``: the ``count`` with the smallest
    hash of (salted ``seed``, ``step``, the sample's global index, the patch), patch dropout's counter-based
    draw (:func:`~mmpretrain.models.patch_dropout.kept_patches`), so the same on resume, at any rank count and
    in any micro-batch."""
    with np.errstate(over="ignore"):
        base = _mix(_mix(np.array([seed], dtype=np.int64).view(np.uint64) ^ np.uint64(MASK_SALT)) ^ np.uint64(step))
        per_sample = _mix(base ^ sample_index.numpy().astype(np.int64).view(np.uint64))
        noise = _mix(per_sample[:, None] ^ _mix(np.arange(num_patches, dtype=np.uint64))[None, :])
    idx = np.argpartition(noise, count - 1, axis=1)[:, :count]
    return torch.from_numpy(np.sort(idx, axis=1).astype(np.int64))


def tower(visual: nn.Module, images: torch.Tensor, masked_index: torch.Tensor | None = None,
          mask_token: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pooled (B, P), tokens (B, N, W))``: an open_clip ViT's pooled output before its projection and its
    patch tokens, the position table fitted to the images' grid, ``masked_index``'s patch embeddings
    replaced by ``mask_token``."""
    x = visual.conv1(images).flatten(2).transpose(1, 2)  # (B, N, W)
    if masked_index is not None:
        masked = torch.zeros(x.shape[:2], dtype=torch.bool, device=x.device).scatter_(1, masked_index.to(x.device), True)
        x = torch.where(masked[..., None], mask_token.to(x.dtype), x)
    cls = visual.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1)
    pos = fit_positions(visual.positional_embedding, 1 + x.shape[1])
    x = torch.cat([cls, x], dim=1) + pos.to(x.dtype)
    x = visual.ln_pre(visual.patch_dropout(x))
    x = visual.transformer(x)
    if visual.attn_pool is not None:  # its tokens are the pooler's queries: the transformer's patch tokens here
        pooled, _ = visual._pool(x)
        return pooled, x[:, 1:]
    pooled, tokens = visual._pool(x)
    return pooled, tokens


def _at(tokens: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return tokens.gather(1, index.to(tokens.device)[..., None].expand(-1, -1, tokens.shape[-1]))


def student_outputs(visual: nn.Module, ssl: SelfSupervised, images: torch.Tensor, inputs: SslInputs) -> dict:
    """``student_local (B, n, K)`` with local crops, ``student_masked (B, M, K)`` with a mask."""
    out = {}
    if inputs.local is not None:
        pooled, _ = tower(visual, inputs.local)
        out["student_local"] = ssl.heads["global"](pooled).unflatten(0, (-1, inputs.count))
    if inputs.masked_index is not None:
        _, tokens = tower(visual, images, inputs.masked_index, ssl.mask_token)
        out["student_masked"] = ssl.heads["patch"](_at(tokens, inputs.masked_index))
    return out


class Teacher(nn.Module):
    """The teacher's outputs of a dual encoder ``model`` (``functional_call`` puts the average's weights in):
    ``teacher_global (B, K)`` when ``global_view``, ``teacher_masked (B, M, K)`` at ``masked_index``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor, global_view: bool, masked_index: torch.Tensor | None) -> dict:
        pooled, tokens = tower(self.model.clip.visual, images)
        heads = self.model.ssl.heads
        out = {}
        if global_view:
            out["teacher_global"] = heads["global"](pooled)
        if masked_index is not None:
            out["teacher_masked"] = heads["patch"](_at(tokens, masked_index))
        return out
