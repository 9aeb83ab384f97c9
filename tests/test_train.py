"""The trainer: exact resume (weights and loss log bit for bit on CPU), non-finite losses handled as
configured, checkpoints kept as configured, configs that change a checkpoint's training refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, run_cli

COMMON = ["train.steps=6", "train.epochs=null", "data.batch_size=16", "data.num_workers=2", "data.shuffle_buffer=32",
          "optim.warmup_steps=2", "train.log_every=1", "train.save_every=3", "train.keep_last=2",
          "train.progress=false"]


def _train(openmoji, run_dir, *extra):
    r = run_cli("mmpretrain.train", "--config", str(ROOT / "configs/demo.yaml"), f"data.train={openmoji / 'train'}",
                f"run_dir={run_dir}", *COMMON, *extra)
    return r


def _losses(run_dir):
    return [{k: v for k, v in r.items() if k.endswith("_loss") or k in ("step", "loss", "lr", "logit_scale")}
            for r in map(json.loads, (run_dir / "log.jsonl").read_text().splitlines())]


def test_resume_after_a_crash_equals_the_uninterrupted_run(openmoji, tmp_path):
    a = tmp_path / "a"
    r = _train(openmoji, a)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.name for p in (a / "checkpoints").iterdir()) == ["step_00000003", "step_00000006"]
    state = json.loads((a / "checkpoints/step_00000003/train_state.json").read_text())
    assert state["loader"][0]["batches"] == 3 and state["step"] == 3

    # the same run killed after step 5 was logged, before its final checkpoint (a half-written one left)
    b = tmp_path / "b"
    shutil.copytree(a, b)
    shutil.rmtree(b / "checkpoints/step_00000006")
    (b / "checkpoints/step_00000006.tmp").mkdir()
    log = (b / "log.jsonl").read_text().splitlines()
    (b / "log.jsonl").write_text("\n".join(log[:5]) + "\n")
    r = _train(openmoji, b)  # the same command: resumes from the run folder's latest checkpoint
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr and "step 3" in r.stderr
    wa = load_file(a / "checkpoints/step_00000006/model.safetensors")
    wb = load_file(b / "checkpoints/step_00000006/model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    assert _losses(a) == _losses(b)  # bit-identical floats, steps 1..6 once each

    # a changed objective is refused
    r = _train(openmoji, b, "loss.1.weight=0.25")
    assert r.returncode == 2 and "loss" in r.stderr and "different config" in r.stderr


class _NanAt:
    def __init__(self, objective, step, run):
        self.objective, self.step, self.run = objective, step, run
        self.init_logit_scale = objective.init_logit_scale

    def __call__(self, **kw):
        out = self.objective(**kw)
        if self.run.step == self.step:
            out = {k: v * float("nan") if k.endswith("_loss") else v for k, v in out.items()}
        return out


@pytest.mark.parametrize("mode", ["stop", "skip"])
def test_nonfinite_loss_is_handled_as_configured(openmoji, tmp_path, mode):
    from mmpretrain.config import load_config
    from mmpretrain.train import fit, setup

    cfg = load_config(ROOT / "configs/demo.yaml", [f"data.train={openmoji / 'train'}", f"run_dir={tmp_path / mode}",
                                                   *COMMON, "train.save_every=1", "data.num_workers=0",
                                                   f"train.nonfinite={mode}", "train.steps=4"])
    run = setup(cfg)
    run.objective = _NanAt(run.objective, 2, run)
    ckpts = tmp_path / mode / "checkpoints"
    if mode == "stop":
        with pytest.raises(FloatingPointError, match="non-finite loss at step 2 .*clip_loss=nan"):
            fit(run)
        assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000001", "step_00000002"]  # none after
    else:
        fit(run)
        log = [json.loads(x) for x in (tmp_path / mode / "log.jsonl").read_text().splitlines()]
        assert [r["nonfinite_steps"] for r in log] == [0, 0, 1, 1]
        w = load_file(ckpts / "step_00000004/model.safetensors")
        assert all(torch.isfinite(v).all() for v in w.values())
