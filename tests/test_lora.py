"""model.lora (peft LoRA in the towers' blocks): the modules it adapts, only the adapters train, a run
resumes bit for bit and trains on 2 gloo ranks, its export (open_clip and transformers) is the merged
model and equals the unmerged one, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mmpretrain.models.lora import target_regex

from conftest import MICRO, run_main, setup_run, train

# the tiny ViT with open_clip's text transformer, both towers trained through adapters
TINY = ["model.arch=mmpt-tiny-vit", "model.lock_text=false", "model.text_from_targets=false",
        "loss=[{name: clip}]", "data.batch_size=16", "data.num_workers=0"]
LORA = "model.lora={rank: 4, alpha: 8, modules: [attn, mlp]}"


def test_the_regex_names_the_blocks_attention_and_mlp_of_each_tower():
    import re

    names = {
        "clip.visual.transformer.resblocks.3.attn": ("image", "attn"),
        "clip.visual.transformer.resblocks.3.mlp.c_fc": ("image", "mlp"),
        "clip.transformer.resblocks.0.mlp.c_proj": ("text", "mlp"),
        "clip.transformer.resblocks.0.attn": ("text", "attn"),
        "clip.text.transformer.encoder.layer.5.attention.self.query": ("text", "attn"),
        "clip.text.transformer.encoder.layer.5.attention.output.dense": ("text", "attn"),
        "clip.text.transformer.encoder.layer.5.intermediate.dense": ("text", "mlp"),
        "clip.text.transformer.encoder.layer.5.output.dense": ("text", "mlp"),
    }
    never = ["clip.visual.transformer.resblocks.3.attn.out_proj", "clip.visual.conv1", "clip.text.proj",
             "clip.visual.transformer.resblocks.3.ln_1", "clip.token_embedding"]
    for towers in (["image"], ["text"], ["image", "text"]):
        for modules in (["attn"], ["mlp"], ["attn", "mlp"]):
            rx = re.compile(target_regex(towers, modules))
            for name, (tower, kind) in names.items():
                assert bool(rx.match(name)) == (tower in towers and kind in modules), (towers, modules, name)
            assert not any(rx.match(n) for n in never)


def test_only_the_adapters_train(openmoji, tmp_path):
    """Image and text towers adapted (MLPs): the adapters and the logit scale train, nothing else moves."""
    from mmpretrain.train import train_step

    run = setup_run(openmoji / "train", tmp_path / "run", "train.steps=2", *TINY, "model.lora={rank: 4}")
    module = run.accelerator.unwrap_model(run.model)
    trained = {n for n, p in module.named_parameters() if p.requires_grad}
    assert trained == {n for n, _ in module.named_parameters() if ".lora_" in n} | {"clip.logit_scale"}
    assert any(".mlp.c_fc.lora_A" in n for n in trained) and not any(".attn." in n for n in trained)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    for _ in range(2):  # lora_B starts at zero: the second step moves lora_A too
        train_step(run, next(iter(run.loader)))
        run.state.step += 1
    for n, p in module.named_parameters():
        assert torch.equal(p, before[n]) == (n not in trained), n


def test_attention_adapters_train_and_their_frozen_weights_drift_only_by_rounding(openmoji, tmp_path):
    """modules=[attn]: peft adds the adapter into open_clip's packed in_proj_weight for each forward and
    subtracts it after, which does not give the frozen weight back bit for bit (stated in
    mmpretrain/models/lora.py); the drift stays at float rounding."""
    from mmpretrain.train import train_step

    run = setup_run(openmoji / "train", tmp_path / "run", "train.steps=4", *TINY, "model.lora={modules: [attn]}")
    module = run.accelerator.unwrap_model(run.model)
    trained = {n for n, p in module.named_parameters() if p.requires_grad}
    assert any(".attn.lora_A" in n for n in trained) and any(".attn.base_layer.out_proj.lora_A" in n for n in trained)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    for _ in range(4):
        train_step(run, next(iter(run.loader)))
        run.state.step += 1
    for n, p in module.named_parameters():
        if n in trained:
            continue
        assert (p - before[n]).abs().max() <= 1e-6 * max(1.0, float(before[n].abs().max())), n
        if ".attn.base_layer." not in n:  # the attention's own weights may drift, nothing else
            assert torch.equal(p, before[n]), n


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "log.jsonl").read_text().splitlines()) if "loss" in r}


def test_a_lora_run_resumes_exactly_and_exports_the_merged_model(openmoji, tmp_path):
    import open_clip
    from transformers import CLIPModel

    run, resumed = tmp_path / "run", tmp_path / "resumed"
    args = ("train.steps=4", "train.save_every=2", "train.keep_last=5", "train.log_every=1", *TINY, LORA,
            "train.ema={decay: 0.5}")
    r = train(openmoji / "train", run, *args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "note: model.lora (rank 4, alpha 8, attn+mlp in image+text)" in r.stderr
    r = train(openmoji / "train", resumed, *args, f"resume={run / 'checkpoints/step_00000002'}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [_losses(resumed)[s] for s in (3, 4)] == [_losses(run)[s] for s in (3, 4)]
    a, b = (load_file(d / "checkpoints/step_00000004/model.safetensors") for d in (run, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # the unmerged model as trained, for reference
    from mmpretrain.config import load_config
    from mmpretrain.losses import build_objective
    from mmpretrain.train.run_setup import build_model

    cfg = load_config(Path(__file__).resolve().parent.parent / "configs/demo.yaml",
                      ["data.train=unused", *TINY[:4], *MICRO, LORA])  # the tower train() trained
    unmerged = build_model(cfg, build_objective([{"name": "clip"}], rank=0, world_size=1, dataset_size=10,
                                                index_size=10)).module
    unmerged.load_state_dict(a, strict=True)
    unmerged.eval()
    g = torch.Generator().manual_seed(0)
    images, tokens = torch.rand(4, 3, 32, 32, generator=g), torch.randint(1, 400, (4, 32), generator=g)
    tokens[:, -3:] = 0
    tokens[:, 0] = 49406
    tokens[torch.arange(4), 20] = 49407
    with torch.no_grad():
        img_ref, txt_ref = unmerged.clip.encode_image(images), unmerged.clip.encode_text(tokens)

    for fmt in ("open_clip", "transformers"):
        out = tmp_path / fmt
        r = run_main("mmpretrain.export", str(run), "--out", str(out), "--format", fmt)
        assert r.returncode == 0, r.stderr[-3000:]
        if fmt == "open_clip":
            model = open_clip.create_model_and_transforms(f"local-dir:{out}")[0].eval()
            assert not any(".lora_" in k or "base_layer" in k for k in model.state_dict())
            with torch.no_grad():
                img, txt = model.encode_image(images), model.encode_text(tokens)
        else:
            model = CLIPModel.from_pretrained(out).eval()
            with torch.no_grad():
                img = model.get_image_features(pixel_values=images)
                txt = model.get_text_features(input_ids=tokens.clamp(max=49407),
                                              attention_mask=(tokens != 0).long())
            img, txt = getattr(img, "pooler_output", img), getattr(txt, "pooler_output", txt)
        torch.testing.assert_close(img, img_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(txt, txt_ref, rtol=1e-5, atol=1e-5)

    # the adapters' average (train.ema) merged on request: another model of the same plain layout
    r = run_main("mmpretrain.export", str(run), "--out", str(tmp_path / "ema"), "--ema")
    assert r.returncode == 0, r.stderr[-3000:]
    plain, avg = (load_file(tmp_path / d / "open_clip_model.safetensors") for d in ("open_clip", "ema"))
    assert plain.keys() == avg.keys() and not all(torch.equal(plain[k], avg[k]) for k in plain)


def test_lora_trains_on_two_gloo_ranks(ddp_checks):
    """2 steps on 2 ranks under accelerate launch (a run of the ddp_checks launch, tests/scripts/ddp_checks.py)."""
    got = ddp_checks["runs"]["lora"]
    assert got["exit"] == 0, got["stderr"]
    w = load_file(ddp_checks["run_dirs"]["lora"] / "checkpoints/step_00000002/model.safetensors")
    assert any(".lora_B." in k and float(v.abs().sum()) > 0 for k, v in w.items())


def test_refusals_are_one_line(openmoji, tmp_path):
    from mmpretrain.config import ConfigError, load_config
    from mmpretrain.models.lora import apply_lora_note

    from conftest import CONFIG

    with pytest.raises(ConfigError, match="model.lora.rnak"):
        load_config(CONFIG, ["data.train=unused", "model.lora={rnak: 4}"])
    with pytest.raises(ConfigError, match="model.lora.modules"):
        load_config(CONFIG, ["data.train=unused", "model.lora={modules: [qkv]}"])
    with pytest.raises(ConfigError, match="text_from_targets=true never runs the text tower"):
        load_config(CONFIG, ["data.train=unused", "model.lora={towers: [image, text]}"])  # the demo: from targets
    cfg = load_config(CONFIG, ["data.train=unused", "model.lora={towers: [image]}"])
    with pytest.raises(ConfigError, match="model.lora under FSDP: not supported here"):
        apply_lora_note(torch.nn.Linear(2, 2), cfg.model, "FSDP")


def test_the_model_card_says_what_was_fine_tuned_from_what_and_how(tmp_path):
    import yaml

    from mmpretrain.export.card import model_card
    from mmpretrain.run_files import RunFolder

    files = RunFolder(tmp_path)
    cfg = {"name": "ft", "model": {"arch": "ViT-B-32", "pretrained": "laion2b_s34b_b79k",
                                   "lora": {"rank": 16, "alpha": 32.0, "towers": ["image", "text"], "modules": ["mlp"]}},
           "optim": {"layer_decay": 0.75}, "loss": [{"name": "clip", "weight": 1.0}]}
    files.config.write_text(yaml.safe_dump(cfg))
    model_cfg = {"vision_cfg": {"image_size": 224}, "text_cfg": {}}
    card = model_card(files, model_cfg, None)
    assert ("- fine-tuned from: `laion2b_s34b_b79k` by LoRA (rank 16, alpha 32, mlp of the image+text tower(s)), "
            "merged into these weights, layer-wise learning-rate decay 0.75") in card
    cfg["model"].pop("lora")
    cfg["model"]["lock_image"] = True
    files.config.write_text(yaml.safe_dump(cfg))
    assert "by full fine-tuning of the unlocked towers" in model_card(files, model_cfg, None)
