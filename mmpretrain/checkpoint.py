"""Checkpoints: ``accelerator.save_state`` for model/optimizer/RNG plus a JSON train state and, for a
stateful objective, its ``state_dict`` as safetensors; resume points, and the configs a resume refuses.

Each checkpoint is written to ``checkpoints/step_{N:08d}.tmp`` and renamed when complete; the
newest folder holding ``train_state.json`` is the latest complete one (:mod:`mmpretrain.run_files`),
so a crash mid-write leaves the previous checkpoint as the one that loads. Objective state is not
saved through accelerate's custom-object checkpointing, which pickles.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from mmpretrain.config import ConfigError, flat_config
from mmpretrain.run_files import OBJECTIVE_STATE, TRAIN_STATE, RunFolder

__all__ = ["load_objective_state", "read_train_state", "resume_point", "save_checkpoint"]


def save_checkpoint(accelerator, files: RunFolder, step: int, train_state: dict[str, Any], keep_last: int | None = None,
                    objective_state: dict[str, torch.Tensor] | None = None) -> Path:
    """``objective_state``: the objective's ``state_dict`` (the same on every rank), written by the main
    process when not empty. Keeps the newest ``keep_last`` complete checkpoints."""
    final = files.checkpoint(step)
    tmp = final.with_name(final.name + ".tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp), safe_serialization=True)
    if accelerator.is_main_process:
        if objective_state:
            save_file({k: v.detach().cpu().contiguous() for k, v in objective_state.items()}, str(tmp / OBJECTIVE_STATE))
        state = dict(train_state, step=step, saved_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        (tmp / TRAIN_STATE).write_text(json.dumps(state, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        if keep_last:
            for old in files.complete_checkpoints()[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_objective_state(objective: torch.nn.Module, ckpt: Path) -> None:
    """Restore a stateful objective from ``ckpt/objective.safetensors`` (a missing file is an error:
    the objective would silently restart its state)."""
    path = Path(ckpt) / OBJECTIVE_STATE
    if not path.is_file():
        raise ConfigError(f"{path} is missing: the checkpoint was written without the objective's state "
                          "(e.g. region weighting's bank, centroids and weights); resume from a checkpoint that has it")
    objective.load_state_dict(load_file(str(path)))


def read_train_state(ckpt: Path) -> dict[str, Any]:
    return json.loads((Path(ckpt) / TRAIN_STATE).read_text())


# settings a resume may change: how long, how often to log/save/evaluate, where to write, kernels
_RESUME_MAY_CHANGE = {"resume", "run_dir", "name", "train.steps", "train.epochs", "train.progress", "train.log_every",
                      "train.save_every", "train.keep_last", "train.nonfinite", "train.max_skipped_steps",
                      "train.log_with", "train.diagnostics_every", "optim.implementation", "data.worker_nice", "eval",
                      "hub"}


def resume_point(resume: str | None, files: RunFolder, config: dict[str, Any]) -> tuple[Path | None, dict[str, Any] | None]:
    """The checkpoint to resume from (``resume``: a checkpoint or run folder; else the run folder's
    latest) and its train state; a ``config`` (the run's, as JSON) that changes what the checkpoint
    was trained with is refused, naming the keys."""
    if resume:
        p = Path(resume)
        ckpt = p if (p / TRAIN_STATE).is_file() else RunFolder(p).latest_checkpoint()
        if ckpt is None:
            raise ConfigError(f"resume={resume}: neither a checkpoint folder (with {TRAIN_STATE}) nor a run "
                              "folder holding one")
    else:
        ckpt = files.latest_checkpoint()
    if ckpt is None:
        return None, None
    saved = read_train_state(ckpt)
    if "loader" not in saved or "config" not in saved:
        raise ConfigError(f"{ckpt} predates resumable checkpoints (no loader position); start a new run_dir "
                          f"with model.pretrained={ckpt}")
    old, new = flat_config(saved["config"]), flat_config(config)
    diff = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k)
                  and k not in _RESUME_MAY_CHANGE and k.split(".")[0] not in _RESUME_MAY_CHANGE)
    if diff:
        what = "; ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in diff[:8])
        raise ConfigError(f"resuming {ckpt} with a different config ({what}). Use the saved config "
                          f"({files.config}) or a new run_dir")
    return ckpt, saved
