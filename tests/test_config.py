from pathlib import Path

import pytest
import yaml

from mmpretrain.config import load_config
from mmpretrain.train import main as train_main
from mmpretrain.train.schedule import resolve_schedule

ROOT = Path(__file__).resolve().parent.parent


def write(tmp_path, data) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


BASE = {"data": {"train": "x"}, "train": {"steps": 10}}


def test_defaults_yaml_overrides_precedence(tmp_path):
    cfg = load_config(write(tmp_path, {**BASE, "optim": {"lr": 0.01}}), ["optim.lr=0.5", "loss.0.weight=2"])
    assert cfg.optim.lr == 0.5 and cfg.loss[0].weight == 2.0
    assert cfg.optim.weight_decay == 0.1  # default kept
    assert cfg.resolved_run_dir == Path("runs/run")


# malformed configs and overrides: tests/reliability/config_corpus.py (each through the CLI)


def test_schedule_resolution():
    from mmpretrain.data.plan import StreamPlan
    from mmpretrain.data.sources import Source

    cfg = load_config(None, ["data.train=x", "train.epochs=2", "data.batch_size=10"])

    def plan(n, workers=1):
        return StreamPlan([Source("x", ["a.tar", "b.tar"], [n - n // 2, n // 2])], "epoch", 0, 2, workers, 10, n, 0)

    s = resolve_schedule(cfg, plan(105).steps_per_epoch, 105, world_size=2)
    assert s.steps_per_epoch == 5 and s.total_steps == 10 and s.warmup_steps == 1
    # 2 ranks x 10: 100 of 105 samples per epoch, 5 steps, whatever the workers; 5 dropped (it was 25 with 2
    # workers: each worker made whole batches of its own)
    assert plan(105, 2).steps_per_epoch == 5 and plan(105, 2).dropped_per_epoch == 5
    with pytest.raises(ValueError, match="lower data.batch_size"):
        plan(15)


def test_train_exits_2_before_work(tmp_path, capsys):
    cfg = write(tmp_path, {**BASE, "modell": {}})
    assert train_main(["--config", str(cfg)]) == 2
    assert "modell: unknown key" in capsys.readouterr().err
    cfg = write(tmp_path, {"data": {"train": str(tmp_path / "missing")}, "train": {"steps": 1}})
    assert train_main(["--config", str(cfg), f"run_dir={tmp_path / 'run'}"]) == 2
    assert not (tmp_path / "run").exists()


TRAIN_CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml") if "accelerate" not in p.parts)


@pytest.mark.parametrize("path", TRAIN_CONFIGS, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_shipped_configs_validate(path):
    cfg = load_config(path)
    head = path.read_text().split("\n")[:12]
    assert any("Launch:" in line for line in head), "each config opens with its launch command"
    assert any("Expected" in line for line in head), "each config states its expected result"
    assert cfg.train.epochs or cfg.train.steps


@pytest.mark.parametrize("path", sorted((ROOT / "configs/accelerate").glob("*.yaml")), ids=lambda p: p.name)
def test_accelerate_configs_parse(path):
    from accelerate.commands.config.config_args import load_config_from_file

    c = load_config_from_file(str(path))
    assert c.num_processes >= 1 and c.distributed_type is not None
