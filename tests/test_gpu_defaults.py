"""The GPU defaults' CPU-visible parts: text-length buckets, channels-last and torch.compile
options through the trainer (the speed they buy is measured on a GPU by scripts/bench/bench_gpu.sh)."""

from __future__ import annotations

import json

import pytest
import torch

from mmpretrain.models.text import trim_padding

from conftest import train


def test_trimmed_lengths_are_bucketed_within_the_context():
    tokens = torch.zeros(3, 32, dtype=torch.long)
    for used, want in ((1, 8), (5, 8), (8, 8), (9, 16), (29, 32), (32, 32)):
        tokens.zero_()
        tokens[1, :used] = 7
        assert trim_padding(tokens, 8).shape == (3, want), used
        assert trim_padding(tokens).shape == (3, used)
    assert trim_padding(torch.zeros(2, 77, dtype=torch.long), 8).shape == (2, 8)  # all padding: one bucket
    assert trim_padding(torch.ones(2, 77, dtype=torch.long), 8).shape == (2, 77)  # never past the context


def _train(openmoji, run_dir, *extra):
    return train(openmoji / "train", run_dir, "train.steps=3", "data.batch_size=16", "data.num_workers=0",
                 "train.log_every=1", "model.arch=mmpt-tiny-vit", "model.lock_text=false",
                 "model.text_from_targets=false", *extra)


def _losses(run_dir):
    return [r["loss"] for r in map(json.loads, (run_dir / "log.jsonl").read_text().splitlines())]


@pytest.mark.parametrize("bad", ["train.channels_last=maybe", "train.text_length_multiple=0", "train.compile=2"])
def test_the_options_are_validated(openmoji, tmp_path, bad):
    r = _train(openmoji, tmp_path / "run", bad)
    assert r.returncode == 2 and bad.split("=")[0] in r.stderr, r.stderr[-1000:]
    assert not (tmp_path / "run").exists()


def test_channels_last_trains_the_same_model(openmoji, tmp_path):
    """The trainable text transformer (bucketed lengths) and channels-last images and weights: the
    losses of the default layout (a memory layout, not a different function)."""
    r = _train(openmoji, tmp_path / "default")
    assert r.returncode == 0, r.stderr[-3000:]
    r = _train(openmoji, tmp_path / "cl", "train.channels_last=true")
    assert r.returncode == 0, r.stderr[-3000:]
    assert _losses(tmp_path / "cl") == pytest.approx(_losses(tmp_path / "default"), rel=1e-5)


@pytest.mark.slow
def test_compile_trains_the_same_model(openmoji, tmp_path):
    """train.compile=true (inductor on this CPU): the eager run's losses, and its checkpoint loads
    without torch.compile's _orig_mod prefix."""
    r = _train(openmoji, tmp_path / "default")
    assert r.returncode == 0, r.stderr[-3000:]
    r = _train(openmoji, tmp_path / "compiled", "train.compile=true")
    assert r.returncode == 0, r.stderr[-3000:]
    assert _losses(tmp_path / "compiled") == pytest.approx(_losses(tmp_path / "default"), rel=1e-4)
    from safetensors.torch import load_file

    keys = load_file(tmp_path / "compiled/checkpoints/step_00000003/model.safetensors").keys()
    assert keys == load_file(tmp_path / "default/checkpoints/step_00000003/model.safetensors").keys()
