"""train.phases: resolving the phases' steps, the refusals, position embeddings resized once by open_clip's
rule, a run killed before, at or after a boundary resumed bit for bit, each phase's evaluation at its own
resolution and the export at the last phase's."""

from __future__ import annotations

import json

import open_clip
import pytest
import torch
from safetensors.torch import load_file

from mmpretrain.config import ConfigError, load_config
from mmpretrain.models import factory
from mmpretrain.train.phases import PositionResize, phase_at, phase_config, resolve_phases
from mmpretrain.train.schedule import Schedule, run_lr

from conftest import CONFIG, MICRO, SHORT, launch, run_main, train

PHASES = "train.phases=[{steps: 3, image_size: 16, patch_dropout: 0.5}, {steps: 3, lr: 2.0e-4, warmup_steps: 1}]"


def _cfg(*overrides: str):
    return load_config(CONFIG, ["data.train=x", "train.epochs=null", *overrides])


def test_phases_resolve_to_steps_and_their_settings():
    cfg = _cfg("train.steps=10", "model.patch_dropout=0.25",
               "train.phases=[{share: 0.75, image_size: 16}, {share: 0.25, patch_dropout: 0, lr: 1.0e-4}]")
    a, b = resolve_phases(cfg, 10)
    assert (a.start, a.end, b.start, b.end) == (0, 8, 8, 10)  # round(0.75 * 10) = 8
    assert a.patch_dropout == 0.25 and b.patch_dropout == 0.0 and a.image_size == 16 and b.image_size is None
    assert phase_at([a, b], 0) is a and phase_at([a, b], 7) is a and phase_at([a, b], 8) is b
    assert phase_at([a, b], 10) is b  # the end: the last phase
    eff = phase_config(cfg, a)
    assert eff.model.overrides["vision_cfg"]["image_size"] == 16 and eff.model.patch_dropout == 0.25
    assert cfg.model.overrides == {} and cfg.model.patch_dropout == 0.25  # the run's own config untouched
    # the run's schedule continues in phase a; phase b has its own: no warm-up, cosine from its lr
    sched = Schedule(10, 2, 100, 800, 8, 1, None)
    assert run_lr(3, cfg, sched, a) == run_lr(3, cfg, sched, None)
    # (the floor at the phase's end, as the run's schedule reaches it at train.steps)
    assert run_lr(8, cfg, sched, b) == pytest.approx(1.0e-4) and run_lr(9, cfg, sched, b) == pytest.approx(5.0e-5)
    # without phases: one phase, the whole run
    (only,) = resolve_phases(_cfg("train.steps=10"), 10)
    assert (only.start, only.end, only.count) == (0, 10, 1)


@pytest.mark.parametrize("phases, message", [
    ("[{steps: 2}, {share: 0.5}]", "every phase steps, or every phase a share"),
    ("[{steps: 2}, {steps: 3}]", "sum to 5; set train.steps to that"),
    ("[{share: 0.5}, {share: 0.4}]", "the shares sum to 0.9, not 1"),
    ("[{steps: 2, batch_size: 64}, {steps: 8}]", "a phase keeps data.batch_size"),
    ("[{steps: 2, share: 0.2}, {steps: 8}]", "exactly one of steps and share"),
    ("[{steps: 10, image_sise: 16}]", "image_sise"),
])
def test_bad_phases_are_refused_with_the_fix(phases, message):
    with pytest.raises(ConfigError, match=message):
        _cfg("train.steps=10", f"train.phases={phases}")


def test_a_phase_of_no_step_and_a_long_warmup_are_refused():
    cfg = _cfg("train.steps=10", "train.phases=[{share: 0.99}, {share: 0.01}]")
    with pytest.raises(ConfigError, match=r"train.phases.1: share 0.01 of the run's 10 steps is no step"):
        resolve_phases(cfg, 10)
    cfg = _cfg("train.steps=10", "train.phases=[{steps: 8}, {steps: 2, warmup_steps: 2}]")
    with pytest.raises(ConfigError, match=r"train.phases.1.warmup_steps=2 must be below the phase's 2 steps"):
        resolve_phases(cfg, 10)


def _vit(size: int):
    cfg = factory.resolve_model_cfg("mmpt-tiny-vit", overrides={
        "embed_dim": 16, "vision_cfg": {"image_size": size, "patch_size": 8, "width": 32, "layers": 1, "head_width": 16},
        "text_cfg": {"context_length": 16, "vocab_size": 100, "width": 32, "heads": 2, "layers": 1}})
    torch.manual_seed(size)
    return factory.build_dual_encoder(cfg, arch="mmpt-tiny-vit")


def test_position_embeddings_are_resized_once_as_open_clip_resizes_them():
    low, high = _vit(32), _vit(64)  # a 4x4 grid of patches to 8x8
    state = low.clip.state_dict()
    want = dict(state)
    open_clip.model.resize_pos_embed(want, high.clip)  # open_clip's rule on the same weights
    assert want["visual.positional_embedding"].shape == (65, 32)
    resize = PositionResize(high.clip.visual)
    high.clip.load_state_dict(state)
    assert torch.equal(high.clip.visual.positional_embedding, want["visual.positional_embedding"])
    assert resize.done == ["position embeddings 4x4 -> 8x8"]
    high.clip.load_state_dict(high.clip.state_dict())  # the same grid: nothing to resize
    assert resize.done == ["position embeddings 4x4 -> 8x8"]
    # AdamW's moments follow the weights (the second one clamped at 0: bicubic can undershoot)
    opt = torch.optim.AdamW(low.clip.parameters())
    low.clip.visual.positional_embedding.grad = torch.randn(17, 32)
    opt.step()
    saved = opt.state_dict()
    opt = torch.optim.AdamW(high.clip.parameters())
    opt.load_state_dict(saved)
    resize.optimizer(opt)
    st = opt.state[high.clip.visual.positional_embedding]
    assert st["exp_avg"].shape == st["exp_avg_sq"].shape == (65, 32) and float(st["exp_avg_sq"].min()) >= 0
    resize.close()


RUN = [PHASES, "train.steps=6", "train.save_every=2", "train.keep_last=9", "data.batch_size=8", "data.num_workers=0",
       "train.log_every=1", "train.ema={decay: 0.5}"]  # the weight average's position embeddings resized too


def test_a_phased_run_resumes_bit_for_bit_on_either_side_of_a_boundary(openmoji, tmp_path):
    data, run = openmoji / "train", tmp_path / "run"
    ev = [f"eval={{every: 3, datasets: ['{openmoji / 'test'}'], tasks: [zeroshot_classification], num_workers: 0}}"]
    r = train(data, run, *RUN, *ev)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "note: phase 1/2, steps 0-3: 16 px, patch dropout 0.5" in r.stderr
    assert r.stderr.count("position embeddings 2x2 -> 4x4") == 1, r.stderr[-3000:]  # resized once, at the boundary
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [f"step_0000000{i}" for i in (2, 3, 4, 6)]  # 3: the boundary
    rows = {s: load_file(ckpts / f"step_0000000{s}/model.safetensors")["clip.visual.positional_embedding"].shape[0]
            for s in (2, 3, 4, 6)}
    assert rows == {2: 5, 3: 5, 4: 17, 6: 17}  # 1 + 2x2 at 16 px, 1 + 4x4 at 32 px
    records = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["phase"], r["eval_image_size"]) for r in records if "eval_image_size" in r]
    assert evals == [(3, 1, 16), (6, 2, 32)]  # each phase evaluated at its own resolution
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]
    lr = {r["step"]: r["lr"] for r in records if "lr" in r}
    assert lr[4] == pytest.approx(2.0e-4)  # phase 2's own warm-up to its lr
    final = load_file(ckpts / "step_00000006/model.safetensors")
    for k in (2, 3, 4):  # killed in phase 1, at the boundary, in phase 2: the same weights at the end
        other = tmp_path / f"from_{k}"
        r = train(data, other, *RUN, f"resume={ckpts / f'step_0000000{k}'}")
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stderr.count("position embeddings 2x2 -> 4x4") == (k <= 3), (k, r.stderr[-2000:])
        got = load_file(other / "checkpoints/step_00000006/model.safetensors")
        assert got.keys() == final.keys() and all(torch.equal(got[n], final[n]) for n in final), k
        x, y = load_file(ckpts / "step_00000006/ema.safetensors"), load_file(other / "checkpoints/step_00000006/ema.safetensors")
        assert x.keys() == y.keys() and all(torch.equal(x[n], y[n]) for n in x), k
        assert x["clip.visual.positional_embedding"].shape == (17, 64)  # the average on the new grid
    # the export is at the last phase's resolution, and its preprocess config says so
    r = run_main("mmpretrain.export", str(run), "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr[-3000:]
    exported = json.loads((tmp_path / "out/open_clip_config.json").read_text())
    assert exported["model_cfg"]["vision_cfg"]["image_size"] == 32
    assert exported["preprocess_cfg"]["size"] in (32, [32, 32])
    resolved = (run / "config.yaml").read_text()
    assert "phases:" in resolved and "image_size: 16" in resolved


def test_two_ranks_cross_a_boundary_and_resume_from_before_it_bit_for_bit(openmoji, tmp_path):
    """Under DDP (2 gloo ranks) the next phase is set up again in every rank's process: the same weights as
    a launch resumed from the checkpoint before the boundary."""
    data, run = openmoji / "train", tmp_path / "run"
    args = [*SHORT, *MICRO, *[a for a in RUN if not a.startswith("train.ema")], "data.num_workers=1"]
    r = launch(run, data, *args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("position embeddings 2x2 -> 4x4") == 1, r.stderr[-2000:]  # the main process says it once
    r = launch(tmp_path / "resumed", data, *args, f"resume={run / 'checkpoints/step_00000002'}")
    assert r.returncode == 0, r.stderr[-3000:]
    a = load_file(run / "checkpoints/step_00000006/model.safetensors")
    b = load_file(tmp_path / "resumed/checkpoints/step_00000006/model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_phase_refusals_are_one_line(openmoji, tmp_path):
    data = openmoji / "train"
    r = train(data, tmp_path / "a", "train.steps=2", "train.phases=[{steps: 1, image_size: 20}, {steps: 1}]")
    assert r.returncode == 2 and "train.phases.0.image_size=20 is not a multiple of the tower's 8-pixel patches: use 16" \
        in r.stderr and "Traceback" not in r.stderr
    small = ("model.overrides={embed_dim: 16, vision_cfg: {layers: [1, 1, 1, 1], width: 8, image_size: 32}, "
             "text_cfg: {width: 32, heads: 2, layers: 1}}")
    r = train(data, tmp_path / "b", "model.arch=RN50", "model.lock_text=false", "model.text_from_targets=false", small,
              "train.steps=2", "train.phases=[{steps: 1, image_size: 16}, {steps: 1}]")
    assert r.returncode == 2 and "ModifiedResNet has no grid of position embeddings" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    r = train(data, tmp_path / "c", "train.steps=2", "train.phases=[{steps: 1, batch_size: 4}, {steps: 1}]")
    assert r.returncode == 2 and "a phase keeps data.batch_size" in r.stderr and "Traceback" not in r.stderr
