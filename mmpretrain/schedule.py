"""Learning-rate schedule and parameter groups: pure functions of their inputs."""

from __future__ import annotations

import math

from torch import nn


def lr_at(step: int, *, base_lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0) -> float:
    """Linear warm-up to ``base_lr`` over ``warmup_steps``, then cosine to ``min_lr_ratio * base_lr``
    at ``total_steps``. ``step`` counts optimizer steps from 0."""
    if warmup_steps > 0 and step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    floor = base_lr * min_lr_ratio
    return floor + 0.5 * (base_lr - floor) * (1 + math.cos(math.pi * progress))


def _no_decay(name: str, p: nn.Parameter) -> bool:
    # open_clip's rule: no weight decay on biases, norms (gains), logit scale and bias, embeddings of dim < 2
    return p.ndim < 2 or "bn" in name or "ln" in name or "norm" in name or "bias" in name or "logit_scale" in name


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if _no_decay(name, p) else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
