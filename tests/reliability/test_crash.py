"""kill -9 of a training process at moments drawn at random, then the same command again: the final
weights and loss log equal an uninterrupted run's bit for bit (CPU)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT

ARGS = ["train.steps=8", "train.epochs=null", "data.batch_size=16", "data.num_workers=2", "data.shuffle_buffer=32",
        "optim.warmup_steps=2", "train.log_every=1", "train.save_every=2", "train.keep_last=2",
        "train.progress=false", "train.log_with=[]", "train.plots=false"]


def _cmd(openmoji, run_dir):
    return [sys.executable, "-m", "mmpretrain.train", "--config", str(ROOT / "configs/demo.yaml"),
            f"data.train={openmoji / 'train'}", f"run_dir={run_dir}", *ARGS]


def _kill_after(cmd, run_dir, step: int, delay: float) -> None:
    """Start training; once checkpoint ``step`` exists wait ``delay`` s and kill -9 the whole process group
    (the trainer and its DataLoader workers)."""
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    target = run_dir / "checkpoints" / f"step_{step:08d}"
    deadline = time.time() + 300
    while not target.is_dir() and p.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(delay)
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
    p.wait()


def _losses(run_dir):
    return [(r["step"], r["loss"], r["clip_loss"], r["soft_target_loss"], r["lr"], r["logit_scale"])
            for r in map(json.loads, (run_dir / "log.jsonl").read_text().splitlines()) if "loss" in r]


def _crash_and_resume(openmoji, tmp_path, kills: int, seed: int):
    a, b = tmp_path / "a", tmp_path / "b"
    r = subprocess.run(_cmd(openmoji, a), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rng = random.Random(seed)
    steps = sorted(rng.sample([2, 4, 6], k=min(kills, 3)))
    while len(steps) < kills:
        steps.append(rng.choice([2, 4, 6]))
    for step in sorted(steps):
        _kill_after(_cmd(openmoji, b), b, step, rng.uniform(0.0, 1.5))
    r = subprocess.run(_cmd(openmoji, b), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    wa = load_file(a / "checkpoints/step_00000008/model.safetensors")
    wb = load_file(b / "checkpoints/step_00000008/model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert _losses(a) == _losses(b) and [x[0] for x in _losses(b)] == list(range(1, 9))


@pytest.mark.slow  # ~45 s; make test keeps a kill -9 during a checkpoint write (below) and the trainer's
# bit-identical resume after a crash (test_train.py)
def test_two_kills_then_resume_is_bit_identical(openmoji, tmp_path):
    _crash_and_resume(openmoji, tmp_path, kills=2, seed=0)


@pytest.mark.slow
def test_five_kills_then_resume_is_bit_identical(openmoji, tmp_path):
    _crash_and_resume(openmoji, tmp_path, kills=5, seed=1)


def test_kill_during_a_checkpoint_write_leaves_the_previous_one_loadable(openmoji, tmp_path):
    from mmpretrain.run_files import latest_checkpoint

    run_dir = tmp_path / "run"
    cmd = _cmd(openmoji, run_dir)
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    ckpts = run_dir / "checkpoints"
    deadline = time.time() + 300
    caught = None
    while p.poll() is None and time.time() < deadline and caught is None:
        # a later checkpoint's temporary folder exists: it is being written right now
        tmp = [d for d in ckpts.glob("step_*.tmp") if d.name != "step_00000002.tmp"] if ckpts.is_dir() else []
        if tmp:
            os.killpg(p.pid, signal.SIGKILL)
            caught = int(tmp[0].name[5:13])
        time.sleep(0.001)
    p.wait()
    assert caught, "no write was caught in progress"
    latest = latest_checkpoint(run_dir)
    assert latest.name == f"step_{caught - 2:08d}"  # the half-written one is never taken
    load_file(latest / "model.safetensors")
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr and f"step {caught - 2}" in r.stderr
