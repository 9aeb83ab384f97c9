"""Damaged checkpoints: verified before a resume, skipped for the newest intact one with a warning that
names what is wrong, refused with the fix when none is intact; a lost RNG state resumes with a warning
and the run records that it is no longer bit-exact."""

from __future__ import annotations

import json
import shutil

import pytest

from mmpretrain.train.checkpoint import verify_checkpoint

from conftest import DEMO_RUN, train


def _train(openmoji, run_dir, steps, *extra):
    """The demo run's command (conftest.DEMO_RUN) for ``steps``: a copy of the run resumes with it."""
    return train(openmoji / "train", run_dir, f"train.steps={steps}", *DEMO_RUN, *extra)


@pytest.fixture
def run4(demo_run):
    """The session's demo run: 4 steps, checkpoints at 2 and 4 (tests copy it before changing anything)."""
    return demo_run


def _resume_damaged(openmoji, run4, tmp_path, damage, name="run"):
    """A copy of the demo run with ``damage(checkpoints folder)`` done to it, resumed to step 6: it must
    finish (exit 0); returns the run folder and the result."""
    run = tmp_path / name
    shutil.copytree(run4, run)
    damage(run / "checkpoints")
    r = _train(openmoji, run, 6)
    assert r.returncode == 0, r.stderr[-3000:]
    return run, r


def _truncate(p):
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


DAMAGE = {
    "model truncated": lambda c: _truncate(c / "model.safetensors"),
    "model garbage": lambda c: (c / "model.safetensors").write_bytes(b"\x07" * 5000),
    "model empty": lambda c: (c / "model.safetensors").write_bytes(b""),
    "model deleted": lambda c: (c / "model.safetensors").unlink(),
    "optimizer truncated": lambda c: _truncate(c / "optimizer.bin"),
    "optimizer deleted": lambda c: (c / "optimizer.bin").unlink(),
    "train state truncated": lambda c: _truncate(c / "train_state.json"),
    "train state not a state": lambda c: (c / "train_state.json").write_text("[1, 2]"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_verify_names_each_kind_of_damage(run4, tmp_path, kind):
    ckpt = tmp_path / "step_00000004"
    shutil.copytree(run4 / "checkpoints/step_00000004", ckpt)
    assert verify_checkpoint(ckpt) == ([], [])
    DAMAGE[kind](ckpt)
    problems, _ = verify_checkpoint(ckpt, world_size=1)
    part = {"model": "model.safetensors", "optimizer": "optimizer.bin", "train": "train_state.json"}[kind.split()[0]]
    assert problems and part in problems[0], problems


def test_a_damaged_latest_checkpoint_falls_back_to_the_newest_intact(openmoji, run4, tmp_path):
    run, r = _resume_damaged(openmoji, run4, tmp_path, lambda c: _truncate(c / "step_00000004/model.safetensors"))
    assert "skipped" in r.stderr and "step_00000004: model.safetensors" in r.stderr
    assert "resumed from" in r.stderr and "step_00000002 at step 2" in r.stderr
    log = [json.loads(x)["step"] for x in (run / "log.jsonl").read_text().splitlines()]
    assert log == [1, 2, 3, 4, 5, 6]  # the records after step 2 belong to the abandoned attempt: replaced
    state = json.loads((run / "checkpoints/step_00000006/train_state.json").read_text())
    assert state["exact_resume"] is True


def test_no_intact_checkpoint_is_refused_with_the_fix(openmoji, run4, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run4, run)
    for c in (run / "checkpoints").iterdir():
        (c / "optimizer.bin").write_bytes(b"")
    r = _train(openmoji, run, 6)
    assert r.returncode == 2 and "every checkpoint" in r.stderr and "start a new run_dir" in r.stderr
    for c in (run / "checkpoints").iterdir():  # folders with no train state at all: said so, not step 0
        (c / "train_state.json").unlink()
    r = _train(openmoji, run, 6)
    assert r.returncode == 2 and "without train_state.json" in r.stderr, r.stderr[-2000:]
    r = _train(openmoji, tmp_path / "other", 6, f"resume={run4 / 'checkpoints/step_00000004'}")
    assert r.returncode == 0, r.stderr[-2000:]  # an intact checkpoint named with resume= still works


def test_a_lost_rng_state_resumes_with_a_warning_and_is_recorded(openmoji, run4, tmp_path):
    run, r = _resume_damaged(openmoji, run4, tmp_path, lambda c: (c / "step_00000004/random_states_0.pkl").unlink())
    assert "random_states_0.pkl: missing" in r.stderr and "not bit-exact" in r.stderr
    state = json.loads((run / "checkpoints/step_00000006/train_state.json").read_text())
    assert state["exact_resume"] is False


class Foreign:
    """An object a weights-only load refuses: what a tampered or foreign checkpoint file holds."""


def _pickled_objects(path):
    import torch

    torch.save({"state": {}, "param_groups": [], "extra": Foreign()}, path)


def test_an_optimizer_with_pickled_objects_is_skipped_like_any_damage(openmoji, run4, tmp_path):
    """An optimizer.bin that holds pickled objects (a torch zip, intact CRCs) is named by verify and the
    resume falls back to the newest intact checkpoint with a warning; it was a traceback and exit 1."""
    ckpt = tmp_path / "step_00000004"
    shutil.copytree(run4 / "checkpoints/step_00000004", ckpt)
    _pickled_objects(ckpt / "optimizer.bin")
    problems, _ = verify_checkpoint(ckpt, world_size=1)
    assert problems and "optimizer.bin: holds pickled objects" in problems[0], problems
    _, r = _resume_damaged(openmoji, run4, tmp_path, lambda c: _pickled_objects(c / "step_00000004/optimizer.bin"))
    assert "Traceback" not in r.stderr and "UnpicklingError" not in r.stderr
    assert "skipped" in r.stderr and "step_00000004: optimizer.bin: holds pickled objects" in r.stderr
    assert "resumed from" in r.stderr and "step_00000002 at step 2" in r.stderr
    # an RNG state with objects in it: resumed without it, not bit-exact, said so
    _, r = _resume_damaged(openmoji, run4, tmp_path, lambda c: _pickled_objects(c / "step_00000004/random_states_0.pkl"),
                           "rng")
    assert "random_states_0.pkl: holds pickled objects" in r.stderr and "not bit-exact" in r.stderr


def test_a_pretrained_file_with_pickled_objects_is_refused_in_one_line(openmoji, run4, tmp_path):
    """model.pretrained=FILE.pt holding objects other than weights: exit 2 before any work, naming the
    file, why, and what is accepted; it was a traceback and exit 1."""
    import torch
    from safetensors.torch import load_file

    bad = tmp_path / "weights.pt"
    weights = load_file(run4 / "checkpoints/step_00000004/model.safetensors")
    torch.save({"state_dict": {k.removeprefix("clip."): v for k, v in weights.items()}, "extra": Foreign()}, bad)
    r = _train(openmoji, tmp_path / "run", 2, f"model.pretrained={bad}")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"model.pretrained={bad}" in errors[0], r.stderr[-2000:]
    assert "pickled objects other than weights" in errors[0] and "refused for safety" in errors[0]
    assert all(w in errors[0] for w in (".safetensors", "weights-only torch file", "run or export folder", "hf-hub:"))
    assert not (tmp_path / "run" / "checkpoints").exists()
    # the same weights as a weights-only file start a run
    good = tmp_path / "good.pt"
    torch.save({"state_dict": {k.removeprefix("clip."): v for k, v in weights.items()}}, good)
    r = _train(openmoji, tmp_path / "run2", 2, f"model.pretrained={good}")
    assert r.returncode == 0, r.stderr[-2000:]
