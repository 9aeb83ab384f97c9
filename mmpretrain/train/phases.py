"""``train.phases``: a run in phases (FLIP's unmasked phase after a masked one, CLIPA's low then full resolution),
each with its steps and any of its own image size, patch dropout and learning-rate schedule.

A phase is a setting of the run, not a second run: the data stream, the optimizer, the step count and the
logs go on across a boundary. At a boundary the trainer takes a checkpoint and sets the run up again from
it in the next phase's settings -- exactly what a resume from that checkpoint does, so a run killed on
either side of a boundary resumes bit for bit. Where the image size changes, the ViT's position embeddings
(and their AdamW moments, and their weight average) are resized once, as the checkpoint loads, by open_clip's
rule (:func:`open_clip.model.resize_pos_embed`: the class token's kept, the grid bicubic with antialiasing).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from mmpretrain.config import ConfigError, ExperimentConfig
from mmpretrain.models.positions import fit_positions, grid_text

__all__ = ["Phase", "PositionResize", "check_phases", "phase_at", "phase_config", "resolve_phases"]


@dataclass(frozen=True)
class Phase:
    """One resolved phase: steps ``[start, end)``, its image size (None: the model's), patch dropout, and its
    own schedule (``lr``, ``warmup_steps``; both None: the run's schedule continues)."""

    index: int
    count: int
    start: int
    end: int
    image_size: int | None = None
    patch_dropout: float = 0.0
    lr: float | None = None
    warmup_steps: int | None = None

    @property
    def own_schedule(self) -> bool:
        return self.lr is not None or self.warmup_steps is not None

    def describe(self) -> str:
        size = f"{self.image_size} px" if self.image_size else "the model's image size"
        lr = (f", its own schedule (lr {self.lr if self.lr is not None else 'optim.lr'}, "
              f"{self.warmup_steps or 0} warm-up steps)" if self.own_schedule else "")
        return (f"phase {self.index + 1}/{self.count}, steps {self.start}-{self.end}: {size}, "
                f"patch dropout {self.patch_dropout:g}{lr}")

    def record(self) -> dict[str, Any]:
        return asdict(self)


def resolve_phases(cfg: ExperimentConfig, total_steps: int) -> list[Phase]:
    """The run's phases over ``total_steps`` (one phase, the config's settings, without ``train.phases``);
    a share's end is rounded to a step, and a phase of no step is refused."""
    given = cfg.train.phases
    if not given:
        return [Phase(0, 1, 0, total_steps, None, cfg.model.patch_dropout)]
    ends, done, share = [], 0, 0.0
    for p in given:
        if p.steps is not None:
            done += p.steps
        else:
            share += p.share
            done = round(share * total_steps)
        ends.append(done)
    ends[-1] = total_steps
    phases, start = [], 0
    for i, (p, end) in enumerate(zip(given, ends)):
        if end <= start:
            raise ConfigError(f"train.phases.{i}: share {p.share} of the run's {total_steps} steps is no step: give "
                              "it a larger share, or the phases steps")
        length = end - start
        if p.warmup_steps is not None and p.warmup_steps >= length:
            raise ConfigError(f"train.phases.{i}.warmup_steps={p.warmup_steps} must be below the phase's {length} steps")
        dropout = cfg.model.patch_dropout if p.patch_dropout is None else p.patch_dropout
        phases.append(Phase(i, len(given), start, end, p.image_size, dropout, p.lr, p.warmup_steps))
        start = end
    return phases


def phase_at(phases: list[Phase], step: int) -> Phase:
    """The phase that step ``step`` (0-based: the next step to take) belongs to; the last one at the end."""
    return next((p for p in phases if step < p.end), phases[-1])


def phase_config(cfg: ExperimentConfig, phase: Phase) -> ExperimentConfig:
    """The config the phase trains with: its patch dropout, and its image size as the image tower's
    (``model.overrides.vision_cfg.image_size``: the model, the loader's crop, evaluation and
    ``model_config.json`` all read it there)."""
    overrides = dict(cfg.model.overrides)
    if phase.image_size is not None:
        overrides["vision_cfg"] = {**(overrides.get("vision_cfg") or {}), "image_size": phase.image_size}
    model = cfg.model.model_copy(update={"patch_dropout": phase.patch_dropout, "overrides": overrides})
    return cfg.model_copy(update={"model": model})


def check_phases(phases: list[Phase], visual: torch.nn.Module, arch: str, sharded: str | None) -> None:
    """A phase's image size needs an open_clip ViT (position embeddings on a square grid), a multiple of
    its patch, and unsharded weights (the resize happens as the checkpoint loads into whole tensors)."""
    from mmpretrain.models.patch_dropout import can_drop

    dropping = next((p for p in phases if p.patch_dropout > 0), None)
    if dropping is not None and not can_drop(visual):
        raise ConfigError(f"train.phases.{dropping.index}.patch_dropout: the image tower of model.arch={arch} is "
                          f"{type(visual).__name__}, which has no patch tokens to drop: use an open_clip ViT arch")
    if not any(p.image_size is not None for p in phases):
        return
    i = next(p.index for p in phases if p.image_size is not None)
    if not hasattr(visual, "grid_size") or not hasattr(visual, "positional_embedding"):
        raise ConfigError(f"train.phases.{i}.image_size: model.arch={arch}'s {type(visual).__name__} has no grid of "
                          "position embeddings to resize; phases of another image size need an open_clip ViT")
    patch = visual.patch_size[0] if isinstance(visual.patch_size, tuple) else visual.patch_size
    for p in phases:
        if p.image_size is not None and p.image_size % patch:
            raise ConfigError(f"train.phases.{p.index}.image_size={p.image_size} is not a multiple of the tower's "
                              f"{patch}-pixel patches: use {max(patch, p.image_size // patch * patch)}")
    if sharded is not None:
        raise ConfigError(f"train.phases changes the image size, which resizes the position embeddings as the "
                          f"boundary checkpoint loads: not offered under {sharded} (sharded weights); train with data "
                          "parallelism (configs/accelerate/8gpu.yaml), or keep one image size")


class PositionResize:
    """Resizes a ViT's position embeddings where a checkpoint of another grid loads into it: a
    ``load_state_dict`` pre-hook on the tower (the weights), then :meth:`optimizer` (AdamW's moments, the
    same rule; the second moment clamped at 0). ``done``: the resizes made, as text."""

    def __init__(self, visual: torch.nn.Module):
        self.visual, self.done = visual, []
        self.handle = visual.register_load_state_dict_pre_hook(self._hook)

    def _hook(self, module, state_dict, prefix, *args) -> None:
        key = prefix + "positional_embedding"
        have = state_dict.get(key)
        want = module.positional_embedding
        if have is not None and have.shape != want.shape:
            state_dict[key] = fit_positions(have, want.shape[0])
            self.done.append(f"position embeddings {grid_text(have.shape[0])} -> {grid_text(want.shape[0])}")

    def optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        param = self.visual.positional_embedding
        state = getattr(optimizer, "optimizer", optimizer).state.get(param, {})
        for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            moment = state.get(name)
            if isinstance(moment, torch.Tensor) and moment.shape != param.shape:
                new = fit_positions(moment, param.shape[0])
                state[name] = new.clamp_min(0) if name != "exp_avg" else new

    def close(self) -> None:
        self.handle.remove()
