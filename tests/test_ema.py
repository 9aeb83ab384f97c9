"""train.ema: the weight average against a naive reference (a module whose weights follow a known path,
and a real run whose checkpoints pin the average at steps 3 and 6), a bit-identical resume, evaluation
of the average beside the trained weights, `mmpretrain.export --ema`, and the refusals."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from mmpretrain.train.ema import EMA

from conftest import run_main, train


def test_the_average_follows_the_naive_reference():
    """Weights set to a known value before each step; the average: a copy up to warmup_steps, then
    decay x ema + (1 - decay) x weights every `every` steps."""
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    module[1].bias.requires_grad_(False)  # not trained: not averaged
    ema = EMA(module, decay=0.8, every=2, warmup_steps=2)
    assert ema.names == ["0.weight", "0.bias", "1.weight"]
    g = torch.Generator().manual_seed(0)
    ref = [p.detach().clone().double() for p in ema.params]
    for step in range(1, 11):
        with torch.no_grad():
            for p in ema.params:
                p.copy_(torch.randn(p.shape, generator=g))
        ema.update(step)
        if step % 2 == 0:
            ref = [p.detach().double().clone() if step <= 2 else 0.8 * r + 0.2 * p.detach().double()
                   for r, p in zip(ref, ema.params)]
        for r, s in zip(ref, ema.shadow):
            torch.testing.assert_close(s.double(), r, rtol=1e-6, atol=1e-7)
    # swapped in for a block, the trained weights back after it
    before = [p.detach().clone() for p in ema.params]
    with ema.swapped_in():
        assert all(torch.equal(p, s) for p, s in zip(ema.params, ema.shadow))
    assert all(torch.equal(p, b) for p, b in zip(ema.params, before))


EMA_RUN = ["train.steps=6", "train.save_every=3", "train.keep_last=5", "data.batch_size=16", "data.num_workers=0",
           "train.ema={decay: 0.9, every: 3, warmup_steps: 3}"]


def _avg(run_dir, step):
    return load_file(run_dir / f"checkpoints/step_{step:08d}/ema.safetensors")


def _weights(run_dir, step):
    return load_file(run_dir / f"checkpoints/step_{step:08d}/model.safetensors")


def test_a_run_averages_resumes_evaluates_and_exports_it(openmoji, tmp_path):
    data = openmoji / "train"
    evals = f"eval={{every: 6, datasets: [{openmoji}], tasks: [zeroshot_classification], num_workers: 0}}"
    run, resumed = tmp_path / "run", tmp_path / "resumed"
    r = train(data, run, *EMA_RUN, evals)
    assert r.returncode == 0, r.stderr[-3000:]
    w3, w6, a3, a6 = _weights(run, 3), _weights(run, 6), _avg(run, 3), _avg(run, 6)
    assert set(a6) <= set(w6) and "clip.visual.conv1.weight" in a6
    assert not any(k.startswith("clip.text.transformer.") for k in a6)  # the locked MiniLM is not averaged
    for k in a6:  # step 3: a copy; step 6: one update from it
        assert torch.equal(a3[k], w3[k].reshape(a3[k].shape)), k
        want = (0.9 * w3[k].double() + 0.1 * w6[k].double()).float().reshape(a6[k].shape)
        torch.testing.assert_close(a6[k], want, rtol=1e-5, atol=1e-7, msg=k)
    assert not torch.equal(a6["clip.visual.conv1.weight"], w6["clip.visual.conv1.weight"])

    # evaluated beside the trained weights
    rows = {e["model"]: e for e in json.loads((run / "results.json").read_text())["results"]}
    assert {"step_6", "step_6_ema"} <= set(rows)
    logged = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    assert any(k.startswith("eval_ema/") for rec in logged for k in rec)

    # a resume from step 3 gives the same average, bit for bit
    r = train(data, resumed, *EMA_RUN, f"resume={run / 'checkpoints/step_00000003'}")
    assert r.returncode == 0, r.stderr[-3000:]
    b6 = _avg(resumed, 6)
    assert all(torch.equal(b6[k], a6[k]) for k in a6)

    # exported on request: the average where it exists, the model's own weights elsewhere
    r = run_main("mmpretrain.export", str(run), "--out", str(tmp_path / "ema"), "--ema")
    assert r.returncode == 0, r.stderr[-3000:]
    out = load_file(tmp_path / "ema/open_clip_model.safetensors")
    for k, v in w6.items():
        src = a6.get(k, v)
        assert torch.equal(out[k.removeprefix("clip.")], src.reshape(out[k.removeprefix("clip.")].shape)), k
    assert "moving average" in (tmp_path / "ema/README.md").read_text()


def test_export_ema_of_a_run_without_one_is_one_line(demo_run, tmp_path):
    r = run_main("mmpretrain.export", str(demo_run), "--out", str(tmp_path / "x"), "--ema")
    assert r.returncode == 2 and "holds no ema.safetensors (the run trained without train.ema)" in r.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("engine", ["DistributedType.FSDP", "DistributedType.DEEPSPEED"])
def test_sharded_engines_refuse_an_average(engine):
    from mmpretrain.config import ConfigError, load_config
    from mmpretrain.train.ema import make_ema

    from conftest import CONFIG

    cfg = load_config(CONFIG, ["data.train=unused", "train.ema={decay: 0.99}"])
    acc = SimpleNamespace(distributed_type=engine)
    with pytest.raises(ConfigError, match="train.ema under .*each rank holds a shard"):
        make_ema(cfg, acc, torch.nn.Linear(2, 2), None)


@pytest.mark.parametrize("value", ["{decay: 1.0}", "{decay: 0.9, every: 0}", "{decy: 0.9}"])
def test_bad_ema_settings_are_config_errors(value):
    from mmpretrain.config import ConfigError, load_config

    from conftest import CONFIG

    with pytest.raises(ConfigError, match="train.ema"):
        load_config(CONFIG, ["data.train=unused", f"train.ema={value}"])
