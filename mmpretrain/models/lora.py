"""``model.lora``: LoRA adapters (peft) in the towers' blocks; only the adapters of the adapted towers
train, and loading a run for evaluation or export merges them into the weights (a plain open_clip
model: nobody downstream needs peft).

Which modules (``modules``):

- ``mlp`` (the default): each block's MLP linears (open_clip ``c_fc``, ``c_proj``; HF
  ``intermediate.dense``, ``output.dense``). The base weights stay bit for bit as loaded.
- ``attn``: each block's attention. open_clip's blocks use ``nn.MultiheadAttention``, whose forward reads
  the packed ``in_proj_weight`` and ``out_proj.weight`` directly, so an adapter on ``out_proj`` as a
  Linear is ignored in training (and merged at export: measured, outputs 0.17 apart) and is not offered;
  peft's ``lora.MultiheadAttention`` adapts both by adding the adapter into ``in_proj_weight`` before
  each forward and subtracting it after. Hugging Face encoders: ``query``, ``key``, ``value`` and the
  attention output ``dense`` (plain linears).

Measured on the packaged tiny ViT (6 image + 4 text blocks, batch 64, rank 8, forward + backward,
operator calls counted by a dispatch mode): no adapter 1,458 calls; ``mlp`` 1,583 (+8.6 %, 204,800
trained parameters); ``attn`` 1,535 (+5.3 %, 122,880); both 2,135 (+46 %, 327,680). ``attn`` costs
fewer calls, but its add-then-subtract does not give the frozen attention weights back exactly: after
100 AdamW steps 47 % of ``in_proj_weight``'s elements had moved, by at most 1.9e-7 (float rounding,
growing with the steps; ``out_proj.weight`` likewise). ``mlp`` keeps the frozen weights frozen and merges exactly, hence the default; ``attn`` is
there for attention adapters, with that drift.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

__all__ = ["TOWERS", "MODULES", "apply_lora", "apply_lora_note", "lora_config", "merge_lora", "target_regex"]

TOWERS = ("image", "text")
# module-name patterns inside a block, per kind: open_clip | Hugging Face BERT-like encoders
MODULES = {
    "attn": (r"resblocks\.\d+\.attn", r"encoder\.layer\.\d+\.attention\.(?:self\.(?:query|key|value)|output\.dense)"),
    "mlp": (r"resblocks\.\d+\.mlp\.(?:c_fc|c_proj)", r"encoder\.layer\.\d+\.(?:intermediate|output)\.dense"),
}


def target_regex(towers: list[str], modules: list[str], prefix: str = "clip.") -> str:
    """peft's ``target_modules`` (a regex matched against whole module names)."""
    inner = "|".join(p for m in modules for p in MODULES[m])
    where = []
    if "image" in towers:
        where.append(rf"{re.escape(prefix)}visual\.(?:.*\.)?(?:{inner})")
    if "text" in towers:
        where.append(rf"{re.escape(prefix)}(?!visual\.)(?:.*\.)?(?:{inner})")
    return "^(?:" + "|".join(where) + ")$"


def lora_config(settings: dict[str, Any], prefix: str = "clip."):
    from peft import LoraConfig

    return LoraConfig(r=settings["rank"], lora_alpha=settings["alpha"], lora_dropout=settings.get("dropout", 0.0),
                      target_modules=target_regex(settings["towers"], settings["modules"], prefix))


def apply_lora(module: nn.Module, settings: dict[str, Any], prefix: str = "clip.") -> tuple[int, int]:
    """Inject the adapters into ``module`` in place; afterwards only the adapters train in the adapted
    towers, and everything outside them keeps the trainability it had (a locked tower stays locked, a
    trained one trains, the logit scale as before). Returns (trained, all) parameter counts."""
    from peft.tuners.lora import LoraModel

    before = {n: p.requires_grad for n, p in module.named_parameters()}
    LoraModel(module, lora_config(settings, prefix), "default")
    adapted = [rf"^{re.escape(prefix)}visual\." if t == "image" else rf"^{re.escape(prefix)}(?!visual\.)(?!logit_)"
               for t in settings["towers"]]
    for name, p in module.named_parameters():
        if ".lora_" in name:
            continue
        base = name.replace(".base_layer", "")
        if any(re.match(a, base) for a in adapted):
            p.requires_grad_(False)
        else:
            p.requires_grad_(before.get(base, before.get(name, False)))
    trained = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return trained, sum(p.numel() for p in module.parameters())


def merge_lora(clip: nn.Module, settings: dict[str, Any], state: dict) -> nn.Module:
    """An open_clip model (``clip``, no adapters yet) with a LoRA run's weights (``state``: adapter and base
    names, as the checkpoint holds them) merged in: the plain architecture, weights ``W + (alpha/r) B A``."""
    from peft.tuners.lora import LoraModel

    tuner = LoraModel(clip, lora_config(settings, prefix=""), "default")
    clip.load_state_dict(state, strict=True)
    return tuner.merge_and_unload()


def apply_lora_note(module: nn.Module, m, engine: str | None) -> None:
    """``model.lora`` (``m``: the model section) on the dual encoder; refused under FSDP and DeepSpeed; the
    trained-parameter count printed (rank 0)."""
    import os
    import sys

    from mmpretrain.config import ConfigError

    if engine is not None:
        raise ConfigError(f"model.lora under {engine}: not supported here (the adapters' frozen base layers and "
                          "peft's per-forward merge into the attention weights are untested under sharding); a LoRA "
                          "fine-tune trains ~1 % of the weights, which data parallelism holds "
                          "(configs/accelerate/8gpu.yaml)")
    trained, total = apply_lora(module, m.lora.model_dump())
    if os.environ.get("RANK", "0") == "0":
        print(f"note: model.lora (rank {m.lora.rank}, alpha {m.lora.alpha:g}, {'+'.join(m.lora.modules)} in "
              f"{'+'.join(m.lora.towers)}): {trained:,} of {total:,} parameters train ({100 * trained / total:.2f} %)",
              file=sys.stderr)
