"""The caption objective and the CoCa decoder: equal to open_clip.loss.CoCaLoss on an open_clip CoCa model
(mmpt-tiny-coca, coca_ViT-B-32's layout at tiny widths) in value and in every parameter's gradient, to naive
float64 code, on 2 gloo ranks; trained from the CLI on the packaged emoji; the refusals."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from open_clip.loss import CoCaLoss

from mmpretrain.losses import LOSSES, build_objective, total_of
from mmpretrain.models import factory

from conftest import ROOT, run_main, train
from ddp_helpers import run_ranks

CONFIG = ROOT / "configs/tiny/caption.yaml"
CAPTIONS = ["a red apple", "grinning face with big eyes", "a cat", "black heart suit", "rocket", "snow capped mountain"]


def tiny_coca(seed: int = 0):
    torch.manual_seed(seed)
    factory.register_packaged_configs()
    cfg = factory.resolve_model_cfg("mmpt-tiny-coca")
    coca = factory.instantiate(cfg, load_text_weights=False)
    tokens = factory.make_tokenizer(cfg)(CAPTIONS)
    images = torch.randn(len(CAPTIONS), 3, 32, 32, generator=torch.Generator().manual_seed(seed))
    return coca, images, tokens


def test_caption_equals_coca_loss_in_value_and_every_gradient():
    coca, images, tokens = tiny_coca()
    coca, images = coca.double(), images.double()  # float64: no summation-order noise between the two
    ref_model = copy.deepcopy(coca)
    ours = factory.DualEncoder(coca)
    objective = build_objective([{"name": "clip"}, {"name": "caption", "weight": 2.0}])
    out = objective(**ours(images, tokens=tokens, caption=True))
    loss = total_of(out)
    loss.backward()

    r = ref_model(images, tokens)
    clip_ref, cap_ref = CoCaLoss(caption_loss_weight=2.0, clip_loss_weight=1.0)(
        r["image_features"], r["text_features"], r["logits"], r["labels"], r["logit_scale"])
    (clip_ref + cap_ref).backward()
    torch.testing.assert_close(out["caption_loss"], cap_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out["clip_loss"], clip_ref, rtol=1e-12, atol=1e-12)
    assert cap_ref.item() > 10  # ~2 x ln(49,408) / 1 at initialisation: the decoder's logits, not a constant
    mine, theirs = dict(coca.named_parameters()), dict(ref_model.named_parameters())
    assert {n for n, p in mine.items() if p.grad is None} == {n for n, p in theirs.items() if p.grad is None}
    for name, p in theirs.items():
        if p.grad is not None:
            torch.testing.assert_close(mine[name].grad, p.grad, rtol=1e-9, atol=1e-12, msg=name)
    assert mine["text_decoder.resblocks.0.attn.in_proj_weight"].grad.abs().sum() > 0


def test_the_decoder_is_initialised():
    """open_clip 3.3 leaves the decoder's vocabulary projection torch.empty (issue #554): zeros stop every
    gradient below it at the first step. init_decoder draws it as open_clip's own init_parameters means to."""
    coca = tiny_coca()[0]
    proj = coca.text_decoder.text_projection
    assert abs(proj.std().item() - 64 ** -0.5) < 0.01
    std = coca.text_decoder.cross_attn[1].mlp.c_proj.weight.std().item()
    assert abs(std - 64 ** -0.5 * 4 ** -0.5) < 0.01


def naive_caption(logits, labels, pad):
    total, n = 0.0, 0
    for i in range(labels.shape[0]):
        for t in range(labels.shape[1]):
            if labels[i, t] != pad:
                total = total - (logits[i, t, labels[i, t]] - torch.logsumexp(logits[i, t], 0))
                n += 1
    return total / n


@pytest.mark.parametrize("pad", [0, 7])
def test_caption_equals_naive_float64(pad):
    g = torch.Generator().manual_seed(pad)
    logits = torch.randn(3, 5, 11, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (3, 5), generator=g)
    labels[0, 3:] = pad
    labels[2, 1:] = pad
    ours = LOSSES["caption"](pad_id=pad)(caption_logits=logits, caption_labels=labels)["caption_loss"]
    ref = naive_caption(logits, labels, pad)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.autograd.grad(ours, logits)[0], torch.autograd.grad(ref, logits)[0],
                               rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda z: LOSSES["caption"](pad_id=pad)(caption_logits=z, caption_labels=labels)["caption_loss"], (logits,))


def _rank_coca(rank, world):
    """Each rank's half of one batch: ours (clip + 2 x caption) and CoCaLoss gathering over the ranks."""
    coca, images, tokens = tiny_coca()
    half = slice(rank * 3, rank * 3 + 3)
    feats = factory.DualEncoder(coca)(images[half], tokens=tokens[half], caption=True)
    leaves = [feats["image_features"], feats["text_features"], feats["caption_logits"]]
    leaves = [v.detach().double().requires_grad_() for v in leaves]
    scale = feats["logit_scale"].detach().double().requires_grad_()
    labels = feats["caption_labels"]
    objective = build_objective([{"name": "clip"}, {"name": "caption", "weight": 2.0}], rank=rank, world_size=world)
    ours = total_of(objective(image_features=leaves[0], text_features=leaves[1], caption_logits=leaves[2],
                              caption_labels=labels, logit_scale=scale, logit_bias=None))
    ref = sum(CoCaLoss(caption_loss_weight=2.0, clip_loss_weight=1.0, rank=rank, world_size=world,
                       gather_with_grad=True)(leaves[0], leaves[1], leaves[2], labels, scale))
    g_ours = torch.autograd.grad(ours, [*leaves, scale])
    g_ref = torch.autograd.grad(ref, [*leaves, scale])
    return ours.detach(), ref.detach(), g_ours, g_ref


def test_caption_on_two_gloo_ranks_equals_coca_loss(tmp_path):
    for ours, ref, g_ours, g_ref in run_ranks(_rank_coca, (), tmp_path):
        torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)
        for a, b in zip(g_ours, g_ref):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_tiny_caption_trains_from_the_cli(openmoji, tmp_path):
    run = tmp_path / "run"
    r = train(openmoji / "train", run, "train.steps=30", "data.num_workers=1", config=CONFIG)
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    caption = [x["caption_unweighted"] for x in records if "caption_unweighted" in x]
    # from ln(49,408) = 10.8 at the start: learnt by the first record (step 10), still falling at 30
    assert len(caption) >= 3 and caption[0] < math.log(49408) - 1 and caption[-1] < caption[0] - 0.5, caption
    assert "builds at most 1,000,000" not in r.stderr  # the start line counts the decoder's logits
    assert f"{64 * 31 * 49408:,}" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("overrides, says", [
    (["model.arch=mmpt-tiny-vit"], "loss caption needs a caption decoder, which model.arch=mmpt-tiny-vit has not"),
    (["loss=[{name: caption}]"], "loss caption trains beside a contrastive term"),
    (["train.micro_batch_size=16"], "use train.micro_batch_mode=accumulate"),
    (["loss=[{name: clip, options: {hard_negatives: true}}, {name: caption}]"], "not offered with the caption decoder"),
    (["loss=[{name: clip}, {name: caption, options: {pad_id: x}}]"], "pad_id must be the tokenizer's padding id"),
])
def test_caption_refusals_name_the_setting(openmoji, tmp_path, overrides, says):
    r = run_main("mmpretrain.train", "--config", str(CONFIG), f"data.train={openmoji / 'train'}",
                 f"run_dir={tmp_path / 'run'}", "train.steps=2", "train.epochs=null", "optim.warmup_steps=1", *overrides)
    assert r.returncode != 0 and says in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_the_decoder_takes_model_overrides_on_a_coca_arch_only():
    cfg = factory.resolve_model_cfg("mmpt-tiny-coca", overrides={"multimodal_cfg": {"context_length": 16},
                                                                 "text_cfg": {"context_length": 16}})
    assert cfg["multimodal_cfg"]["context_length"] == 16 and cfg["multimodal_cfg"]["layers"] == 2  # merged, not replaced
    with pytest.raises(ValueError, match="did you mean context_length"):
        factory.resolve_model_cfg("mmpt-tiny-coca", overrides={"multimodal_cfg": {"contxt_length": 16}})
    with pytest.raises(ValueError, match="has no caption decoder to change"):
        factory.resolve_model_cfg("mmpt-tiny-vit", overrides={"multimodal_cfg": {"layers": 1}})


def test_caption_on_two_processes_through_accelerate_launch(openmoji, tmp_path):
    """DDP over 2 gloo processes as a user launches it (the decoder a module of the DDP-wrapped model, its
    gradients all-reduced with the towers'): every step logged, the caption term falling, both ranks' samples."""
    from conftest import launch

    run = tmp_path / "run"
    r = launch(run, openmoji / "train", "train.steps=8", "train.epochs=null", "data.batch_size=16",
               "data.num_workers=1", "optim.warmup_steps=1", "train.log_every=1", "model.arch=mmpt-tiny-coca",
               "model.lock_text=false", "model.text_from_targets=false",
               "loss=[{name: clip}, {name: caption, weight: 2.0}]")
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    caption = [x["caption_unweighted"] for x in records if "caption_unweighted" in x]
    assert len(caption) == 8 and caption[-1] < caption[0] - 0.5, caption
    assert records[-1]["samples"] == 8 * 32  # 16 per rank x 2 ranks
