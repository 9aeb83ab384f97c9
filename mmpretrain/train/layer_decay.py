"""Layer-wise learning-rate decay (``optim.layer_decay``): the BEiT fine-tuning scheme over each tower's
own depth. A tower of ``L`` blocks has layers ``0..L+1``: its embeddings (patch/token embedding,
position embedding, class token, the pre-norm, a ResNet's stem) are layer 0, block ``i`` is layer
``i + 1``, and what follows the blocks (final norm, projection, attention pooling) is layer ``L + 1``;
a parameter of layer ``l`` trains at ``lr x decay^(L + 1 - l)``. A ResNet image tower counts its four
stages as its blocks. The logit scale and bias train at ``lr``. timm's ``param_groups_layer_decay``
cannot group open_clip's towers (they have no ``group_matcher``), hence this.

Which tower and layer a parameter belongs to is read from its name in the dual encoder
(``clip.visual.*``: the image tower; ``clip.text.*`` or open_clip's text at the model's root: the text
tower); the depth from every parameter of the tower, trained or not, so locking part of a tower does
not move the rates of the rest.
"""

from __future__ import annotations

import re
from collections import defaultdict

from torch import nn


def no_decay_rule(name: str, p: nn.Parameter) -> bool:
    """open_clip's rule: no weight decay on biases, norms (gains), logit scale and bias, embeddings of dim < 2."""
    return p.ndim < 2 or "bn" in name or "ln" in name or "norm" in name or "bias" in name or "logit_scale" in name


__all__ = ["layer_decay_groups", "layer_decay_note", "layer_of", "no_decay_rule", "tower_depths"]

# block index inside a tower: open_clip's transformers, timm's trunks, Hugging Face encoders
_BLOCK = re.compile(r"(?:resblocks|blocks|encoder\.layers?|layers)\.(\d+)\.")
_STAGE = re.compile(r"^layer([1-9])\.")  # open_clip's ModifiedResNet stages
_IMAGE_EMBED = ("class_embedding", "positional_embedding", "conv1.", "ln_pre.", "patch_embed", "trunk.patch_embed.",
                "trunk.cls_token", "trunk.pos_embed", "trunk.reg_token", "bn1.", "conv2.", "bn2.", "conv3.", "bn3.")
_TEXT_EMBED = ("token_embedding", "positional_embedding", "embeddings.", "transformer.embeddings.", "cls_emb")


def _split(name: str) -> tuple[str, str]:
    """(tower, name within the tower): ``image``, ``text`` or ``logit`` (scale and bias)."""
    name = name.removeprefix("clip.")
    if name.startswith("visual."):
        return "image", name[len("visual."):]
    if name.startswith("text."):
        return "text", name[len("text."):]
    if name.startswith("logit_"):
        return "logit", name
    return "text", name  # open_clip's CLIP keeps its text tower at the root


def _block(tower: str, rel: str) -> int | None:
    m = _STAGE.match(rel) if tower == "image" else None
    if m:
        return int(m.group(1)) - 1
    m = _BLOCK.search(rel)
    return int(m.group(1)) if m else None


def tower_depths(model: nn.Module) -> dict[str, int]:
    """Blocks per tower (ResNet: stages), from every parameter's name."""
    depth: dict[str, int] = defaultdict(int)
    for name, _ in model.named_parameters():
        tower, rel = _split(name)
        b = _block(tower, rel)
        if b is not None:
            depth[tower] = max(depth[tower], b + 1)
    return dict(depth)


def layer_of(name: str, depths: dict[str, int]) -> tuple[str, int, int]:
    """(tower, layer, tower depth L) of a parameter: layer 0 embeddings, ``i + 1`` block ``i``, ``L + 1``
    the head; the logit scale and bias are ``("logit", 0, -1)`` (scale 1)."""
    tower, rel = _split(name)
    if tower == "logit":
        return tower, 0, -1
    depth = depths.get(tower, 0)
    b = _block(tower, rel)
    if b is not None:
        return tower, b + 1, depth
    embed = _IMAGE_EMBED if tower == "image" else _TEXT_EMBED
    return tower, 0 if rel.startswith(embed) else depth + 1, depth


def layer_decay_groups(model: nn.Module, weight_decay: float, decay: float,
                       no_decay) -> tuple[list[dict], list[tuple[str, int, float, int]]]:
    """AdamW parameter groups, one per (tower, layer, decayed or not), each with its ``lr_scale``;
    and the table printed at start: (tower, layer, lr scale, parameters) per layer that trains."""
    depths = tower_depths(model)
    groups: dict[tuple, dict] = {}
    sizes: dict[tuple, int] = defaultdict(int)
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        tower, layer, depth = layer_of(name, depths)
        scale = 1.0 if tower == "logit" else decay ** (depth + 1 - layer)
        wd = 0.0 if no_decay(name, p) else weight_decay
        key = (tower, layer, wd)
        group = groups.setdefault(key, {"params": [], "weight_decay": wd, "lr_scale": scale,
                                        "name": f"{tower}.{layer}"})
        group["params"].append(p)
        sizes[(tower, layer, scale)] += p.numel()
    table = sorted((t, layer, s, n) for (t, layer, s), n in sizes.items())
    return list(groups.values()), table


def layer_decay_note(module: nn.Module, o) -> str:
    """The learning-rate table ``optim.layer_decay`` gives: per tower and layer, its scale of ``optim.lr``
    and how many trained parameters it holds."""
    _, table = layer_decay_groups(module, o.weight_decay, o.layer_decay, no_decay_rule)
    depths = tower_depths(module)
    lines = [f"note: optim.layer_decay={o.layer_decay}: lr x layer_decay^(L + 1 - layer) per tower "
             f"({', '.join(f'{t} L={d}' for t, d in sorted(depths.items()))}; layer 0 embeddings, L + 1 the head)",
             "  tower  layer  lr scale  lr         parameters"]
    for tower, layer, scale, n in table:
        lines.append(f"  {tower:<5}  {layer:>5}  {scale:8.4f}  {o.lr * scale:.3e}  {n:>10,}")
    return "\n".join(lines)
