"""Data parallelism through ``accelerate launch`` on 2 CPU processes: objectives that leave a model
parameter unused still train, and every rank draws its own dropout / patch-dropout masks."""

import json
import subprocess
import sys

from conftest import ROOT


def _launch(openmoji, tmp_path, check: str) -> dict:
    report = tmp_path / f"{check}.json"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "configs/accelerate/cpu-2proc.yaml"), str(ROOT / "tests/scripts/ddp_checks.py"),
           str(openmoji / "train"), str(tmp_path / "runs"), str(report), check]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(report.read_text())


def test_ddp_trains_objectives_that_leave_a_parameter_unused(openmoji, tmp_path):
    res = _launch(openmoji, tmp_path, "unused")
    for case in ("vrn", "align_uniform", "clip_with_bias"):
        assert res.get(f"unused_{case}") == "ok", res


def test_each_rank_draws_its_own_dropout_masks(openmoji, tmp_path):
    res = _launch(openmoji, tmp_path, "masks")
    assert res["same_initial_weights"], res  # the model starts the same on every rank
    assert res["masks_differ"], res  # but patch dropout on the same images draws other masks on rank 1
