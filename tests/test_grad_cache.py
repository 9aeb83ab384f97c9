"""Gradient caching gives the whole batch's gradient (a ViT with patch dropout, whose RNG is replayed);
plain accumulation gives the mean of the micro-batch objectives' gradients, which differs."""

from __future__ import annotations

import pytest
import torch

from mmpretrain.losses import build_objective
from mmpretrain.models.factory import build_dual_encoder, resolve_model_cfg
from mmpretrain.train.grad_cache import forward_backward


@pytest.fixture(scope="module")
def setup():
    from accelerate import Accelerator

    torch.manual_seed(0)
    cfg = resolve_model_cfg("mmpt-tiny-vit", None, {"vision_cfg": {"layers": 2, "patch_dropout": 0.5},
                                                     "text_cfg": {"layers": 2}})
    model = build_dual_encoder(cfg, lock_text=False, text_from_targets=False).double().train()
    objective = build_objective([{"name": "clip", "weight": 1.0, "options": {}},
                                 {"name": "soft_target", "weight": 0.5, "options": {}}], rank=0, world_size=1,
                                dataset_size=1000)
    g = torch.Generator().manual_seed(1)
    images = torch.randn(16, 3, 32, 32, generator=g, dtype=torch.float64)
    tokens = torch.randint(1, 1000, (16, 32), generator=g)
    targets = torch.nn.functional.normalize(torch.randn(16, 24, generator=g, dtype=torch.float64), dim=-1)
    return Accelerator(cpu=True), model, objective, images, tokens, targets


def _grads(setup, micro, mode, seed=3):
    acc, model, objective, images, tokens, targets = setup
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # patch dropout draws from here
    out = forward_backward(acc, model, objective, images, tokens, targets, micro_batch=micro, mode=mode)
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_grad_cache_equals_the_whole_batch(setup):
    full_out, full = _grads(setup, None, "grad_cache")
    out, cached = _grads(setup, 4, "grad_cache")
    assert full.keys() == cached.keys() and "clip.logit_scale" in full
    assert torch.equal(out.loss, full_out.loss) or torch.allclose(out.loss, full_out.loss, rtol=1e-12)
    for n in full:
        torch.testing.assert_close(cached[n], full[n], rtol=1e-9, atol=1e-12, msg=n)


def test_patch_dropout_is_active(setup):
    # patch dropout really draws random patches here (a different seed changes the gradient), so the
    # equality above holds only because the re-forward replays the first forward's RNG
    _, a = _grads(setup, 4, "grad_cache", seed=3)
    _, b = _grads(setup, 4, "grad_cache", seed=4)
    assert not torch.allclose(a["clip.visual.conv1.weight"], b["clip.visual.conv1.weight"])


def test_accumulation_is_the_mean_of_micro_batch_objectives(setup):
    acc, model, objective, images, tokens, targets = setup
    _, accumulated = _grads(setup, 4, "accumulate")
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    for i in range(0, 16, 4):  # naive: each micro-batch its own loss, gradients averaged
        s = slice(i, i + 4)
        feats = model(images[s], tokens=tokens[s])
        out = objective(**feats, target_embeddings=targets[s])
        (sum(v for k, v in out.items() if k.endswith("_loss")) / 4).backward()
    naive = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for n in naive:
        torch.testing.assert_close(accumulated[n], naive[n], rtol=1e-9, atol=1e-12, msg=n)
    _, full = _grads(setup, None, "grad_cache")
    assert not torch.allclose(accumulated["clip.visual.conv1.weight"], full["clip.visual.conv1.weight"])


class _Fp16Accelerator:
    """What accelerate does for fp16 (it refuses fp16 on a CPU, so emulated): autocast in float16 and a
    GradScaler-style backward of ``loss * scale`` (the caller unscales the gradients)."""

    scale = 2.0 ** 16

    @staticmethod
    def autocast():
        return torch.autocast("cpu", dtype=torch.float16)

    def backward(self, loss):
        (loss * torch.tensor(self.scale)).backward()  # as GradScaler.scale: a 0-d fp32 scale, so fp32

    @staticmethod
    def no_sync(model):
        from contextlib import nullcontext

        return nullcontext()

    @staticmethod
    def unwrap_model(model):
        return model


class _Towers(torch.nn.Module):
    """Two linear towers with a logit scale: the DualEncoder call signature, cheap at N = 4,096."""

    def __init__(self):
        super().__init__()
        self.image, self.text = torch.nn.Linear(32, 64), torch.nn.Linear(32, 64)
        self.clip = torch.nn.Module()
        self.clip.logit_scale = torch.nn.Parameter(torch.tensor(100.0).log())
        self.clip.logit_bias = None

    def forward(self, images, tokens=None, target_embeddings=None):
        return {"image_features": torch.nn.functional.normalize(self.image(images), dim=-1),
                "text_features": torch.nn.functional.normalize(self.text(tokens), dim=-1),
                "logit_scale": self.clip.logit_scale.exp(), "logit_bias": None}


def test_fp16_grad_cache_gradients_do_not_underflow():
    """Grad caching runs the objective's own backward outside the GradScaler; at N = 4,096 its
    dL/dfeatures (~1/N^2) underflows in fp16 unless it is computed in fp32."""
    from accelerate import Accelerator

    torch.manual_seed(0)
    model = _Towers()
    g = torch.Generator().manual_seed(1)
    n = 4096
    images = torch.randn(n, 32, generator=g)
    texts = images + 0.5 * torch.randn(n, 32, generator=g)
    objective = build_objective([{"name": "clip", "weight": 1.0}])

    def grads(acc, micro, unscale=1.0):
        model.zero_grad(set_to_none=True)
        forward_backward(acc, model, objective, images, texts, micro_batch=micro, mode="grad_cache")
        return torch.cat([p.grad.flatten() / unscale for p in model.parameters()])

    ref = grads(Accelerator(cpu=True), None)  # fp32, the whole batch
    acc = _Fp16Accelerator()
    cached = grads(acc, 512, acc.scale)
    rel = float((cached - ref).norm() / ref.norm())
    print(f"fp16 grad cache vs fp32 whole batch: {rel:.2%}")
    assert rel < 0.03, f"fp16 grad-cache gradient {rel:.1%} off the fp32 whole batch"
