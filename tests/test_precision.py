"""Objectives under CPU mixed precision (torch.autocast in bf16 and fp16, as accelerate runs them):
value and gradient within 3 % of fp32, tiled and not, on confident rows at scale 100."""

import math

import pytest
import torch
import torch.nn.functional as F

from mmpretrain.losses import LOSSES

N, D, E = 256, 64, 32
TILED = ("clip", "sigmoid", "soft_target")
CASES = [("clip", {}), ("clip", {"local_loss": True}), ("sigmoid", {}), ("sigmoid", {"within_view_negatives": True}),
         ("soft_target", {}), ("soft_target", {"space": "image_image"}), ("cwcl", {}), ("vrn", {"delta": 0.0}),
         ("align_uniform", {})]
AMP = [(n, o, c) for n, o in CASES for c in ([None, 64] if n in TILED else [None])]


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(0)
    x = F.normalize(torch.randn(N, D, generator=g), dim=-1)
    y = F.normalize(x + 0.3 * torch.randn(N, D, generator=g), dim=-1)  # each row's positive stands out
    x2 = F.normalize(x + 0.3 * torch.randn(N, D, generator=g), dim=-1)
    t = F.normalize(x[:, :E] + 0.5 * torch.randn(N, E, generator=g), dim=-1)
    return x, y, x2, t


def loss_and_grad(name, options, chunk, batch, dtype):
    x, y, x2 = (v.clone().requires_grad_() for v in batch[:3])
    t = batch[3]
    fn = LOSSES[name](chunk_size=chunk, **options)
    kw = dict(image_features=x, text_features=y, logit_scale=torch.tensor(100.0), logit_bias=torch.tensor(-10.0),
              target_embeddings=t, image_features_2=x2)
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        out = fn(**kw)[f"{name}_loss"]
    # backward outside the autocast region, as the trainer runs it
    gx, gy = torch.autograd.grad(out, (x, y), allow_unused=True)
    return out.float(), torch.cat([torch.zeros_like(x) if gx is None else gx.float(),
                                   torch.zeros_like(y) if gy is None else gy.float()])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name, options, chunk", AMP, ids=[f"{n}-{o}-chunk{c}" for n, o, c in AMP])
def test_autocast_value_and_gradient_within_3_percent_of_fp32(batch, name, options, chunk, dtype):
    ref, g_ref = loss_and_grad(name, options, chunk, batch, None)
    out, g = loss_and_grad(name, options, chunk, batch, dtype)
    out, ref = out.detach(), ref.detach()
    assert torch.isfinite(out), f"{name} loss {float(out)} under {dtype}"
    assert float((out - ref).abs() / ref.abs()) < 0.03, (float(out), float(ref))
    rel = float((g - g_ref).norm() / g_ref.norm())
    assert rel < 0.03, f"gradient {rel:.1%} off fp32"


def test_bf16_training_on_cpu(openmoji, tmp_path):
    """train.precision=bf16 runs the mixed-precision path end to end on a CPU (accelerate's CPU bf16
    autocast), through the command line (accelerate's state is per process): a tiny run, weights kept
    in fp32, finite losses; fp32 is a spelling of no."""
    import json

    from safetensors.torch import load_file

    from mmpretrain.config import load_config

    from conftest import ROOT, run_cli

    common = [f"data.train={openmoji / 'train'}", "train.steps=2", "train.epochs=null", "data.batch_size=16",
              "data.num_workers=0", "optim.warmup_steps=1", "train.log_every=1", "train.progress=false",
              "train.log_with=[]", "model.arch=mmpt-tiny-vit", "model.lock_text=false", "model.text_from_targets=false",
              # tiny enough for CPUs that emulate bf16 (~1 GFLOP/s there)
              "model.overrides={embed_dim: 64, vision_cfg: {layers: 1, width: 64, head_width: 32}, "
              "text_cfg: {layers: 1, width: 64, heads: 2}}"]
    assert load_config(ROOT / "configs/demo.yaml", [*common, "train.precision=fp32"]).train.precision == "no"
    r = run_cli("mmpretrain.train", "--config", str(ROOT / "configs/demo.yaml"), *common,
                f"run_dir={tmp_path / 'bf16'}", "train.precision=bf16")
    assert r.returncode == 0, r.stderr[-3000:]
    log = [json.loads(x) for x in (tmp_path / "bf16/log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2] and all(math.isfinite(r["loss"]) for r in log)
    assert "precision: bf16" in (tmp_path / "bf16/config.yaml").read_text()
    weights = load_file(tmp_path / "bf16/checkpoints/step_00000002/model.safetensors")
    assert {v.dtype for v in weights.values()} == {torch.float32}
