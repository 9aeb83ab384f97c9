"""What ``self_distill`` and ``masked_prediction`` take from the run (:mod:`mmpretrain.losses.self_supervised`):
the checks of the config, made once where the model is built, and the heads put on the model."""

from __future__ import annotations

from mmpretrain.config import ConfigError, ExperimentConfig
from mmpretrain.losses import WeightedObjective
from mmpretrain.models.patch_dropout import can_drop, num_patches
from mmpretrain.models.ssl import SelfSupervised


def attach_self_supervised(cfg: ExperimentConfig, objective: WeightedObjective, module, sharded: str | None) -> None:
    """``module.ssl``: the heads of the objective's self-supervised terms, after the config's checks (each
    refusal one line naming the setting and the fix)."""
    specs = objective.ssl_heads
    if not specs:
        return
    names = " and ".join(n for n in objective.names if n in ("self_distill", "masked_prediction"))
    if set(objective.names) <= {"self_distill", "masked_prediction"}:
        raise ConfigError(f"loss {names} trains beside a contrastive term, as SigLIP 2 does: add {{name: sigmoid}} (or "
                          "clip) to loss")
    visual = module.clip.visual
    if not can_drop(visual) or cfg.data.naflex is not None:
        raise ConfigError(f"loss {names} runs an open_clip ViT's patch tokens, which model.arch={cfg.model.arch}'s "
                          f"{type(visual).__name__} does not have: use an open_clip ViT arch (mmpt-tiny-vit, ViT-B-16)")
    if sharded is not None:
        raise ConfigError(f"loss {names} under {sharded}: the teacher is the train.ema average, which each rank would "
                          "hold a shard of (train.ema is refused there): train with data parallelism "
                          "(configs/accelerate/8gpu.yaml)")
    if cfg.train.ema is None:
        raise ConfigError(f"loss {names}: the teacher is the train.ema weight average: set train.ema (e.g. {{decay: "
                          "0.996, warmup_steps: S}} with S the start step, SigLIP 2's teacher initialised from the "
                          "student)")
    t = cfg.train
    if t.micro_batch_size is not None and t.micro_batch_mode == "grad_cache":
        raise ConfigError(f"loss {names} with train.micro_batch_mode=grad_cache: its loss is per sample, with no "
                          "batch term to cache; use train.micro_batch_mode=accumulate")
    local = objective.local_crops
    patch = visual.conv1.kernel_size[0]
    if local is not None and local.size % patch:
        raise ConfigError(f"loss self_distill: options.local_size={local.size} is not a whole number of the tower's "
                          f"{patch}-pixel patches: use {max(patch, local.size // patch * patch)}")
    objective.for_tower(num_patches(visual))
    module.ssl = SelfSupervised(visual, specs)
