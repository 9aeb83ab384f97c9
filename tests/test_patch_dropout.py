"""model.patch_dropout (FLIP): the seeded draw, the tower's forward against a naive per-sample reference in
value and gradient, P = 0 bit for bit, one mask across grad caching's two forwards, evaluation and the
saved weights unmasked, a resume bit for bit, and the refusals."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from mmpretrain.models import factory
from mmpretrain.models.patch_dropout import KeptPatches, keep_count, kept_patches

from conftest import run_main, train

TINY = {"embed_dim": 16, "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 32, "layers": 2, "head_width": 16},
        "text_cfg": {"context_length": 16, "vocab_size": 100, "width": 32, "heads": 2, "layers": 1}}


def _model(prob: float = 0.5, **extra) -> factory.DualEncoder:
    cfg = factory.resolve_model_cfg("mmpt-tiny-vit", overrides={**TINY, **extra})
    torch.manual_seed(0)
    return factory.build_dual_encoder(cfg, arch="mmpt-tiny-vit", patch_dropout_prob=prob).double()


def _batch(b: int = 6):
    g = torch.Generator().manual_seed(1)
    return torch.randn(b, 3, 32, 32, generator=g, dtype=torch.float64), torch.randint(1, 99, (b, 16), generator=g)


def test_the_draw_is_a_function_of_seed_step_and_sample():
    idx = torch.tensor([5, 9, 2, 5])
    keep = kept_patches(idx, seed=3, step=7, num_patches=196, prob=0.5)
    assert keep.shape == (4, 98) and keep.dtype == torch.long and keep.shape[1] == keep_count(196, 0.5)
    assert all(torch.equal(k.unique(), k) for k in keep)  # ascending, no repeat
    assert int(keep.min()) >= 0 and int(keep.max()) < 196
    assert torch.equal(keep[0], keep[3])  # the same sample in one step: the same patches
    # a sample's mask does not depend on the batch around it (rank count, order)
    assert torch.equal(kept_patches(torch.tensor([9]), 3, 7, 196, 0.5)[0], keep[1])
    assert torch.equal(kept_patches(idx, 3, 7, 196, 0.5), keep)
    for other in (kept_patches(idx, 4, 7, 196, 0.5), kept_patches(idx, 3, 8, 196, 0.5)):
        assert not torch.equal(other, keep)
    # uniform over patches: each of 16 patches kept by about half of 4,000 draws
    many = kept_patches(torch.arange(4000), 0, 0, 16, 0.5)
    share = torch.bincount(many.flatten(), minlength=16) / 4000
    assert share.sub(0.5).abs().max() < 0.05, share
    assert keep_count(49, 0.75) == 12 and keep_count(4, 0.9) == 1  # open_clip's count: int(N (1 - P)), at least 1
    assert torch.equal(kept_patches(idx, 0, 0, 16, 0.0), torch.arange(16).expand(4, -1))


def _naive_features(model, images, keep):
    """Each sample alone: the class token and the kept patches' embeddings picked by a Python loop."""
    v = model.clip.visual
    out = []
    for b in range(images.shape[0]):
        x = v.conv1(images[b:b + 1]).flatten(2).transpose(1, 2)
        x = torch.cat([v.class_embedding.view(1, 1, -1), x], 1) + v.positional_embedding
        x = x[:, [0] + [1 + int(i) for i in keep[b]]]
        x = v.transformer(v.ln_pre(x))
        pooled, _ = v._global_pool(v.ln_post(x))
        out.append(torch.nn.functional.normalize(pooled @ v.proj, dim=-1))
    return torch.cat(out)


def test_the_masked_tower_equals_a_naive_reference_in_value_and_gradient():
    model = _model()
    images, tokens = _batch()
    keep = kept_patches(torch.arange(6), 0, 1, 16, 0.5)
    got = model(images, tokens, patch_keep=keep)["image_features"]
    want = _naive_features(model, images, keep)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    w = torch.randn_like(got)
    g_got = torch.autograd.grad((got * w).sum(), list(model.clip.visual.parameters()))
    g_want = torch.autograd.grad((want * w).sum(), list(model.clip.visual.parameters()))
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    # masking changes the features; without indices the tower sees every patch
    assert not torch.allclose(got, model(images, tokens)["image_features"])


def test_p0_and_eval_are_the_unmasked_tower_bit_for_bit():
    plain, masked = _model(prob=0.0), _model(prob=0.5)
    assert not isinstance(plain.clip.visual.patch_dropout, KeptPatches)
    assert isinstance(masked.clip.visual.patch_dropout, KeptPatches)
    images, tokens = _batch()
    # the same weights and state dict: nothing to export differently
    assert plain.state_dict().keys() == masked.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), masked.state_dict().values()))
    everything = kept_patches(torch.arange(6), 0, 0, 16, 0.0)
    a = plain(images, tokens)["image_features"]
    b = masked(images, tokens, patch_keep=everything)["image_features"]
    assert torch.equal(a, b)
    ga = torch.autograd.grad(a.sum(), list(plain.clip.visual.parameters()))
    gb = torch.autograd.grad(b.sum(), list(masked.clip.visual.parameters()))
    assert all(torch.equal(x, y) for x, y in zip(ga, gb))
    # evaluation calls encode_image, in eval mode or not: never masked
    for mode in (True, False):
        masked.train(mode)
        plain.train(mode)
        assert torch.equal(masked.clip.encode_image(images), plain.clip.encode_image(images))
    assert masked.clip.visual.patch_dropout.keep is None  # the indices never outlive their forward


class _Acc:
    device = torch.device("cpu")

    def autocast(self):
        return torch.autocast("cpu", enabled=False)

    def no_sync(self, model):
        return torch.autocast("cpu", enabled=False)

    def backward(self, loss):
        loss.backward()


def test_grad_cache_replays_each_micro_batch_mask(monkeypatch):
    from mmpretrain.losses import build_objective
    from mmpretrain.train.grad_cache import forward_backward

    images, tokens = _batch(8)
    keep = kept_patches(torch.arange(8), 0, 3, 16, 0.5)
    objective = build_objective([{"name": "clip"}]).double()
    seen = []
    forward = KeptPatches.forward

    def record(self, x):
        seen.append(self.keep.clone())
        return forward(self, x)

    monkeypatch.setattr(KeptPatches, "forward", record)
    grads = []
    for micro in (None, 3):
        model = _model()
        forward_backward(_Acc(), model, objective, images, tokens, patch_keep=keep, micro_batch=micro)
        grads.append([p.grad.clone() for p in model.clip.visual.parameters()])
    whole, cached = seen[0], seen[1:]
    assert torch.equal(whole, keep) and len(cached) == 6  # 3 micro-batches, twice
    for j, s in enumerate([slice(0, 3), slice(3, 6), slice(6, 8)]):
        assert torch.equal(cached[j], keep[s]) and torch.equal(cached[3 + j], keep[s])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


RUN = ["model.patch_dropout=0.5", "train.steps=4", "train.save_every=2", "train.keep_last=5", "data.batch_size=8",
       "data.num_workers=0", "train.log_every=1"]


def test_a_run_with_patch_dropout_resumes_bit_for_bit_and_exports_unmasked(openmoji, tmp_path):
    data, run, resumed = openmoji / "train", tmp_path / "run", tmp_path / "resumed"
    r = train(data, run, *RUN)
    assert r.returncode == 0, r.stderr[-3000:]
    r = train(data, resumed, *RUN, f"resume={run / 'checkpoints/step_00000002'}")
    assert r.returncode == 0, r.stderr[-3000:]
    a = load_file(run / "checkpoints/step_00000004/model.safetensors")
    b = load_file(resumed / "checkpoints/step_00000004/model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the same run unmasked trains other weights
    plain = tmp_path / "plain"
    assert train(data, plain, *RUN[1:]).returncode == 0
    c = load_file(plain / "checkpoints/step_00000004/model.safetensors")
    assert not torch.equal(a["clip.visual.conv1.weight"], c["clip.visual.conv1.weight"])
    # the export is open_clip's unmasked tower: no patch_dropout in its config
    r = run_main("mmpretrain.export", str(run), "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr[-3000:]
    cfg = json.loads((tmp_path / "out/open_clip_config.json").read_text())["model_cfg"]
    assert not cfg["vision_cfg"].get("patch_dropout")


def test_refusals_are_one_line(openmoji, tmp_path):
    data = openmoji / "train"
    r = train(data, tmp_path / "a", "model.overrides={vision_cfg: {patch_dropout: 0.5}}", "train.steps=1")
    assert r.returncode == 2 and "set model.patch_dropout instead" in r.stderr and "Traceback" not in r.stderr
    r = train(data, tmp_path / "b", "model.patch_dropout=1.0", "train.steps=1")
    assert r.returncode == 2 and "model.patch_dropout" in r.stderr and "Traceback" not in r.stderr
    with pytest.raises(ValueError, match="ModifiedResNet, which has no patch tokens to drop"):
        small = {"embed_dim": 16, "vision_cfg": {"layers": [1, 1, 1, 1], "width": 8, "image_size": 32},
                 "text_cfg": {"width": 32, "heads": 2, "layers": 1, "vocab_size": 100}}
        factory.build_dual_encoder(factory.resolve_model_cfg("RN50", overrides=small), arch="RN50",
                                   patch_dropout_prob=0.5)
