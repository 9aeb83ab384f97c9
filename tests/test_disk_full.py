"""A disk that cannot hold the run's checkpoints: refused at the start when not even one fits, noted when
``train.keep_last`` of them do not; a save that runs out of space mid-run ends the run with one line,
takes back the partial checkpoint, keeps the last complete one, and the same command resumes from it."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

from mmpretrain.run_files import RunFolder
from mmpretrain.train.checkpoint import save_checkpoint
from mmpretrain.train.disk import CheckpointWriteError, check_disk, checkpoint_bytes

from conftest import train

MIB = 2**20


def _module() -> torch.nn.Module:
    m = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
    m[0].requires_grad_(False)  # a frozen tower: saved, but no optimizer state
    return m


def test_checkpoint_bytes_count_weights_and_adamw_state_of_trainable_parameters():
    m = _module()
    weights, optim = checkpoint_bytes(m)
    assert weights == 4 * (256 * 256 + 256 + 256 * 4 + 4)
    assert optim == 8 * (256 * 4 + 4)
    # FSDP/DeepSpeed: the sharded layout plus the gathered fp32 model.safetensors beside it
    assert checkpoint_bytes(m, "FSDP") == (2 * weights, optim)


def test_check_disk_refuses_notes_or_passes(tmp_path):
    m = _module()
    need = sum(checkpoint_bytes(m))
    files = RunFolder(tmp_path / "not/yet/made")  # the nearest existing parent's disk is asked
    with pytest.raises(CheckpointWriteError, match=r"run_dir=.*not/yet/made: its disk has .* GiB free and one "
                                                   r"checkpoint needs .*free space there or set run_dir"):
        check_disk(files, m, keep_last=3, free=need - 1)
    note = check_disk(files, m, keep_last=3, free=2 * need)
    assert "room for 2 checkpoint(s)" in note and "train.keep_last=3 keeps 4" in note
    assert check_disk(files, m, keep_last=3, free=4 * need) is None
    assert check_disk(files, m, keep_last=3) is None  # this disk holds far more than 4 x 0.3 MiB


class _Acc:
    """What save_checkpoint uses of an Accelerator, one process; ``fail``: what save_state raises after
    writing part of the model file."""

    distributed_type = "DistributedType.NO"
    process_index, num_processes, is_main_process = 0, 1, True

    def __init__(self, fail: Exception | None = None):
        self.fail = fail

    def wait_for_everyone(self):
        pass

    def save_state(self, folder: str, safe_serialization: bool = True):
        Path(folder).mkdir(parents=True, exist_ok=True)
        if self.fail is not None:
            (Path(folder) / "model.safetensors").write_bytes(b"\0" * MIB)
            raise self.fail
        torch.save({}, Path(folder) / "optimizer.bin")


@pytest.mark.parametrize("error", [
    OSError(errno.ENOSPC, "No space left on device"),
    SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),  # safetensors'
    RuntimeError("[enforce fail at inline_container.cc:626] . PytorchStreamWriter failed writing file data/0: "
                 "file write failed, No space left on device"),  # torch.save's
], ids=["oserror", "safetensors", "torch"])
def test_a_save_out_of_space_keeps_the_last_checkpoint_and_takes_back_the_partial_one(tmp_path, error):
    files = RunFolder(tmp_path / "run")
    first = save_checkpoint(_Acc(), files, 3, {"samples": 3})
    with pytest.raises(CheckpointWriteError, match=r"saving checkpoint step 6 .*no space left on the disk .*"
                                                   r"step_00000003, is intact"):
        save_checkpoint(_Acc(error), files, 6, {"samples": 6})
    assert sorted(p.name for p in files.checkpoints.iterdir()) == ["step_00000003"]  # no step_00000006.tmp
    assert files.latest_checkpoint() == first
    assert json.loads((first / "train_state.json").read_text())["step"] == 3


def test_any_other_write_error_is_raised_as_it_was(tmp_path):
    with pytest.raises(PermissionError, match="Permission denied"):
        save_checkpoint(_Acc(PermissionError(errno.EACCES, "Permission denied")), RunFolder(tmp_path), 3, {})


def test_the_cli_refuses_a_disk_without_room_and_resumes_after_a_save_ran_out_of_space(openmoji, tmp_path,
                                                                                      monkeypatch):
    import accelerate

    from mmpretrain.train import disk

    run = tmp_path / "run"
    args = (openmoji / "train", run, "train.steps=4", "train.save_every=2", "data.batch_size=16",
            "data.num_workers=0")
    with monkeypatch.context() as m:
        m.setattr(disk, "free_bytes", lambda path: 10 * MIB)
        r = train(*args)
    assert r.returncode == 2, r.stderr
    assert "error: run_dir=" in r.stderr and "one checkpoint needs" in r.stderr and "Traceback" not in r.stderr

    save_state, calls = accelerate.Accelerator.save_state, []

    def runs_out(self, folder, **kw):
        calls.append(folder)
        if len(calls) == 2:  # the step-4 checkpoint: part written, then the disk is full
            Path(folder).mkdir(parents=True, exist_ok=True)
            (Path(folder) / "model.safetensors").write_bytes(b"\0" * MIB)
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return save_state(self, folder, **kw)

    with monkeypatch.context() as m:
        m.setattr(accelerate.Accelerator, "save_state", runs_out)
        r = train(*args)
    assert r.returncode == 1, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "saving checkpoint step 4" in lines[0] and "step_00000002, is intact" in lines[0]
    assert "Traceback" not in r.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002"]

    r = train(*args)  # the same command, space freed: resumes from step 2 and finishes
    assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stderr and "step_00000002 at step 2" in r.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]
