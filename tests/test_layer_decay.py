"""optim.layer_decay (BEiT's layer-wise learning-rate decay over each tower's depth) against a naive
per-block reference written here, for open_clip's ViT and text transformer, a Hugging Face text tower
and a ResNet image tower; the schedule scales each group's own rate; a bad value is one config error."""

from __future__ import annotations

import re

import open_clip
import pytest

from mmpretrain.train.layer_decay import layer_decay_groups
from mmpretrain.train.layer_decay import no_decay_rule as _no_decay
from mmpretrain.train.schedule import lr_at

from conftest import DEMO_TOWER, setup_run

DECAY = 0.7


def reference_scale(name: str, depth: dict[str, int]) -> float:
    """The scale of ``name`` by hand: embeddings at layer 0, block i at i + 1, the rest at L + 1."""
    name = name.removeprefix("clip.")
    if name in ("logit_scale", "logit_bias"):
        return 1.0
    if name.startswith("visual."):
        rel, L = name[7:], depth["image"]
        if m := re.match(r"transformer\.resblocks\.(\d+)\.", rel):
            layer = int(m.group(1)) + 1
        elif m := re.match(r"layer(\d)\.", rel):  # ResNet stage k = block k - 1
            layer = int(m.group(1))
        elif rel in ("class_embedding", "positional_embedding", "conv1.weight", "ln_pre.weight", "ln_pre.bias",
                     "bn1.weight", "bn1.bias", "conv2.weight", "bn2.weight", "bn2.bias", "conv3.weight",
                     "bn3.weight", "bn3.bias"):
            layer = 0
        else:  # ln_post, proj, attnpool
            layer = L + 1
        return DECAY ** (L + 1 - layer)
    rel, L = name.removeprefix("text."), depth["text"]
    if m := re.match(r"(?:transformer\.resblocks|transformer\.encoder\.layer)\.(\d+)\.", rel):
        layer = int(m.group(1)) + 1
    elif rel in ("token_embedding.weight", "positional_embedding") or rel.startswith("transformer.embeddings."):
        layer = 0
    else:  # ln_final, text_projection, proj
        layer = L + 1
    return DECAY ** (L + 1 - layer)


def scales_of(model, weight_decay=0.1):
    groups, table = layer_decay_groups(model, weight_decay, DECAY, _no_decay)
    by_param = {}
    for g in groups:
        for p in g["params"]:
            by_param[id(p)] = (g["lr_scale"], g["weight_decay"])
    return {n: by_param[id(p)] for n, p in model.named_parameters() if p.requires_grad}, table


@pytest.mark.parametrize("arch,depth", [("mmpt-tiny-vit", {"image": 6, "text": 4}), ("RN50", {"image": 4, "text": 12})])
def test_open_clip_towers_get_the_reference_scales(arch, depth):
    from mmpretrain.models import factory

    factory.register_packaged_configs()
    model = open_clip.create_model(arch)
    got, table = scales_of(model)
    assert len(got) == len(list(model.parameters()))
    for name, p in model.named_parameters():
        assert got[name][0] == pytest.approx(reference_scale(name, depth), rel=1e-12), name
        assert got[name][1] == (0.0 if _no_decay(name, p) else 0.1), name
    # the table: every layer of both towers, its parameters counted once
    assert sum(n for *_, n in table) == sum(p.numel() for p in model.parameters())
    assert {(t, layer) for t, layer, *_ in table} >= {("image", 0), ("image", depth["image"] + 1), ("text", 0)}


def test_a_hugging_face_text_tower_and_a_locked_part(openmoji, tmp_path):
    """The demo's MiniLM text tower (encoder.layer.N), trained whole; then with the text tower locked:
    the image tower's rates do not move and nothing frozen is in a group."""
    run = setup_run(openmoji / "train", tmp_path / "run", *DEMO_TOWER, "model.lock_text=false", "model.text_from_targets=false",
                    "data.num_workers=0", "data.batch_size=16", "train.steps=2", f"optim.layer_decay={DECAY}")
    model = run.model.module if hasattr(run.model, "module") else run.model
    got, _ = scales_of(model)
    for name in got:
        assert got[name][0] == pytest.approx(reference_scale(name, {"image": 6, "text": 6}), rel=1e-12), name
    assert any(n.startswith("clip.text.transformer.encoder.layer.5.") for n in got)

    # the schedule: every group trains at the step's rate times its own scale
    from mmpretrain.train import train_step

    train_step(run, next(iter(run.loader)))
    sched = run.schedule
    lr = lr_at(0, base_lr=run.cfg.optim.lr, warmup_steps=sched.warmup_steps, total_steps=sched.total_steps,
               min_lr_ratio=run.cfg.optim.min_lr_ratio)
    assert len(run.optimizer.param_groups) > 20
    for g in run.optimizer.param_groups:
        assert g["lr"] == pytest.approx(lr * g["lr_scale"], rel=1e-12)

    locked = setup_run(openmoji / "train", tmp_path / "locked", *DEMO_TOWER, "data.num_workers=0", "data.batch_size=16",
                       "train.steps=2", f"optim.layer_decay={DECAY}")  # the demo: text tower locked, proj trains
    lmodel = locked.model.module if hasattr(locked.model, "module") else locked.model
    lgot, _ = scales_of(lmodel)
    assert {n for n in lgot if n.startswith("clip.text.")} == {"clip.text.proj.weight"}
    assert lgot["clip.text.proj.weight"][0] == 1.0  # the head of a 6-block tower, locked blocks included
    assert all(lgot[n] == got[n] for n in lgot if n.startswith("clip.visual."))


@pytest.mark.parametrize("value", ["1.5", "0", "-0.1"])
def test_a_layer_decay_outside_its_range_is_one_config_error(value):
    from mmpretrain.config import ConfigError, load_config

    from conftest import CONFIG

    with pytest.raises(ConfigError, match="optim.layer_decay"):
        load_config(CONFIG, ["data.train=unused", f"optim.layer_decay={value}"])
