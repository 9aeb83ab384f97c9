"""Every malformed config and override of the corpus (config_corpus.py) stops
``python -m mmpretrain.train`` with exit 2 before any work, in a message that names the key."""

from __future__ import annotations

import pytest

from mmpretrain.config import load_config
from mmpretrain.train import main as train_main
from reliability.config_corpus import CASES, materialise


def test_corpus_is_large_and_ids_unique():
    assert len(CASES) >= 70
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_malformed_config_exits_2_naming_the_key(case, tmp_path, openmoji, capsys, monkeypatch):
    argv, env, needle = materialise(case, tmp_path, openmoji.parent / "openmoji")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    rc = train_main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert needle in err
    assert "Traceback" not in err and err.count("\n") <= 12
    # nothing trained, nothing written
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_duration_override_replaces_the_other(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("data: {train: x}\ntrain: {epochs: 3}\n")
    c = load_config(cfg, ["train.steps=7"])
    assert (c.train.steps, c.train.epochs) == (7, None)
    cfg.write_text("data: {train: x}\ntrain: {steps: 3}\n")
    c = load_config(cfg, ["train.epochs=2"])
    assert (c.train.steps, c.train.epochs) == (None, 2)
    c = load_config(cfg, ["train.epochs=2", "train.steps=5"])  # the later one wins
    assert (c.train.steps, c.train.epochs) == (5, None)
