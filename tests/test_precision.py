"""Objectives under CPU mixed precision (torch.autocast in bf16 and fp16, as accelerate runs them):
value and gradient within 3 % of fp32, tiled and not, on confident rows at scale 100."""

import math

import pytest
import torch

from mmpretrain.testing.precision import agreement, amp_cases, structured_batch

N, D, E = 256, 64, 32
AMP = amp_cases(64)


@pytest.fixture(scope="module")
def batch():
    return structured_batch(N, D, E)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name, options, chunk", AMP, ids=[f"{n}-{o}-chunk{c}" for n, o, c in AMP])
def test_autocast_value_and_gradient_within_3_percent_of_fp32(batch, name, options, chunk, dtype):
    res = agreement(name, options, chunk, batch, dtype)
    assert math.isfinite(res["loss"]), f"{name} loss {res['loss']} under {dtype}"
    assert res["loss_rel"] < 0.03, res
    assert res["grad_rel"] < 0.03, f"gradient {res['grad_rel']:.1%} off fp32"


def test_bf16_training_on_cpu(openmoji, tmp_path):
    """train.precision=bf16 runs the mixed-precision path end to end on a CPU (accelerate's CPU bf16
    autocast), through the trainer's main (accelerate's process-wide state reset around it): a tiny run,
    weights kept in fp32, finite losses; fp32 is a spelling of no."""
    import json

    from safetensors.torch import load_file

    from mmpretrain.config import load_config

    from conftest import ROOT, SHORT, train

    common = [f"data.train={openmoji / 'train'}", *SHORT, "train.steps=2", "data.batch_size=16", "data.num_workers=0",
              "train.log_every=1", "model.arch=mmpt-tiny-vit", "model.lock_text=false", "model.text_from_targets=false",
              # tiny enough for CPUs that emulate bf16 (~1 GFLOP/s there)
              "model.overrides={embed_dim: 64, vision_cfg: {layers: 1, width: 64, head_width: 32}, "
              "text_cfg: {layers: 1, width: 64, heads: 2}}"]
    assert load_config(ROOT / "configs/demo.yaml", [*common, "train.precision=fp32"]).train.precision == "no"
    r = train(openmoji / "train", tmp_path / "bf16", *common[1:], "train.precision=bf16")
    assert r.returncode == 0, r.stderr[-3000:]
    log = [json.loads(x) for x in (tmp_path / "bf16/log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2] and all(math.isfinite(r["loss"]) for r in log)
    assert "precision: bf16" in (tmp_path / "bf16/config.yaml").read_text()
    weights = load_file(tmp_path / "bf16/checkpoints/step_00000002/model.safetensors")
    assert {v.dtype for v in weights.values()} == {torch.float32}
