"""The run's schedule in steps, the learning-rate schedule and parameter groups: pure functions of their inputs."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from mmpretrain.config import ConfigError, ExperimentConfig
from mmpretrain.train.layer_decay import layer_decay_groups, no_decay_rule


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

    @property
    def batch_size(self) -> int:
        """Samples per rank per step (``data.batch_size``)."""
        return self.global_batch_size // self.world_size

    def epoch_at(self, step: int) -> float:
        """Epochs completed after ``step`` steps (steps / steps per epoch)."""
        return step / self.steps_per_epoch


def resolve_schedule(cfg: ExperimentConfig, steps_per_epoch: int, num_samples: int, world_size: int,
                     batch_size: int | None = None) -> Schedule:
    """Durations converted to steps once, from the stream's steps per epoch (mmpretrain/data/plan.py), and
    the global batch (``batch_size``, default ``data.batch_size``, x ``world_size``; with ``data.naflex`` the
    largest step's, which the memory declarations hold at), which everything after setup reads from here."""
    if cfg.train.steps is not None:
        total = cfg.train.steps
    else:
        total = max(1, math.ceil(cfg.train.epochs * steps_per_epoch))
    warmup = cfg.optim.warmup_steps if cfg.optim.warmup_steps is not None else total // 10
    if warmup >= total:
        raise ConfigError(f"optim.warmup_steps={warmup} must be below the {total} total steps")
    diag = cfg.train.diagnostics_every
    if diag == "auto":  # about 50 points over the run, on logging steps
        every = cfg.train.log_every
        diag = every * max(1, round(total / (50 * every)))
    return Schedule(total_steps=total, warmup_steps=warmup, steps_per_epoch=steps_per_epoch, num_samples=num_samples,
                    global_batch_size=(batch_size or cfg.data.batch_size) * world_size, world_size=world_size, diagnostics_every=diag)


def lr_at(step: int, *, base_lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0) -> float:
    """Linear warm-up to ``base_lr`` over ``warmup_steps``, then cosine to ``min_lr_ratio * base_lr``
    at ``total_steps``. ``step`` counts optimizer steps from 0."""
    if warmup_steps > 0 and step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    floor = base_lr * min_lr_ratio
    return floor + 0.5 * (base_lr - floor) * (1 + math.cos(math.pi * progress))


def run_lr(step: int, cfg: ExperimentConfig, schedule: Schedule, phase=None) -> float:
    """The learning rate of optimizer step ``step``: the run's schedule, or the phase's own (``train.phases``
    with ``lr`` or ``warmup_steps``: warm-up and cosine over the phase's steps, :mod:`mmpretrain.train.phases`)."""
    o = cfg.optim
    if phase is None or not phase.own_schedule:
        return lr_at(step, base_lr=o.lr, warmup_steps=schedule.warmup_steps, total_steps=schedule.total_steps,
                     min_lr_ratio=o.min_lr_ratio)
    return lr_at(step - phase.start, base_lr=o.lr if phase.lr is None else phase.lr,
                 warmup_steps=phase.warmup_steps or 0, total_steps=phase.end - phase.start, min_lr_ratio=o.min_lr_ratio)


def param_groups(model: nn.Module, weight_decay: float, layer_decay: float | None = None) -> list[dict]:
    """AdamW's groups: decayed and not (open_clip's rule); with ``layer_decay`` one group per tower layer
    and decay, each with its ``lr_scale`` (:mod:`mmpretrain.train.layer_decay`)."""
    if layer_decay is not None:
        return layer_decay_groups(model, weight_decay, layer_decay, no_decay_rule)[0]
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if no_decay_rule(name, p) else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
