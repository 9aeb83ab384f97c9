"""The run's schedule in steps, the learning-rate schedule and parameter groups: pure functions of their inputs."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Schedule:
    """Durations in optimizer steps, resolved once from the config and the data stream (written into the
    run's ``config.yaml`` under ``resolved``)."""

    total_steps: int
    warmup_steps: int
    steps_per_epoch: int  # of the stream: every rank takes this many steps per epoch
    num_samples: int  # per epoch: the dataset (epoch mode) or the budget (resampled)
    global_batch_size: int
    world_size: int
    diagnostics_every: int | None  # geometry diagnostics cadence in steps (None: off)

    def epoch_at(self, step: int) -> float:
        """Epochs completed after ``step`` steps (steps / steps per epoch)."""
        return step / self.steps_per_epoch


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
