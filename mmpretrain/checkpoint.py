"""Checkpoints: ``accelerator.save_state`` for model/optimizer/scheduler plus a JSON train state.

Each checkpoint is written to ``checkpoints/step_{N:08d}.tmp`` and renamed when complete; the
newest folder holding ``train_state.json`` is the latest complete one, so a crash mid-write leaves
the previous checkpoint as the one that loads.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmpretrain.models.factory import latest_checkpoint

if TYPE_CHECKING:
    from mmpretrain.config import ExperimentConfig

__all__ = ["OBJECTIVE_STATE", "load_objective_state", "save_checkpoint", "latest_checkpoint", "read_train_state", "resume_point"]


OBJECTIVE_STATE = "objective.safetensors"


def save_checkpoint(accelerator, run_dir: Path, step: int, train_state: dict[str, Any], keep_last: int | None = None,
                    objective_state: dict[str, Any] | None = None) -> Path:
    """``objective_state``: a stateful objective's ``state_dict`` (region weighting's bank, centroids,
    weights; the same on every rank), written as ``objective.safetensors`` by the main process --
    not through accelerate's custom-object checkpointing, which pickles."""
    final = Path(run_dir) / "checkpoints" / f"step_{step:08d}"
    tmp = final.with_name(final.name + ".tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp), safe_serialization=True)
    if accelerator.is_main_process:
        if objective_state:
            from safetensors.torch import save_file

            save_file({k: v.detach().cpu().contiguous() for k, v in objective_state.items()}, str(tmp / OBJECTIVE_STATE))
        state = dict(train_state, step=step, saved_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        (tmp / "train_state.json").write_text(json.dumps(state, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        if keep_last:
            done = sorted((p for p in final.parent.iterdir() if p.name.startswith("step_") and
                           not p.name.endswith(".tmp") and (p / "train_state.json").is_file()),
                          key=lambda p: p.name)
            for old in done[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_objective_state(objective, ckpt: Path) -> None:
    """Restore a stateful objective from ``ckpt/objective.safetensors`` (a missing file is an error:
    the objective would silently restart its state)."""
    from safetensors.torch import load_file

    from mmpretrain.config import ConfigError

    path = Path(ckpt) / OBJECTIVE_STATE
    if not path.is_file():
        raise ConfigError(f"{path} is missing: the checkpoint was written without the objective's state "
                          "(region weighting's bank, centroids and weights); resume from a checkpoint that has it")
    objective.load_state_dict(load_file(str(path)))


def read_train_state(ckpt: Path) -> dict[str, Any]:
    return json.loads((Path(ckpt) / "train_state.json").read_text())


_RESUME_MAY_CHANGE = {"resume", "run_dir", "name", "train.steps", "train.epochs", "train.progress", "train.log_every",
                      "train.save_every", "train.keep_last", "train.nonfinite", "train.max_skipped_steps",
                      "train.log_with", "train.diagnostics_every", "optim.implementation", "data.worker_nice", "eval",
                      "hub"}


def flat_config(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flat_config(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def resume_point(cfg: ExperimentConfig, run_dir: Path) -> tuple[Path | None, dict[str, Any] | None]:
    """The checkpoint to resume from (``resume=PATH``, else the run folder's latest) and its train state;
    a config that changes what the checkpoint was trained with is refused, naming the keys."""
    from mmpretrain.config import ConfigError

    ckpt = None
    if cfg.resume:
        p = Path(cfg.resume)
        ckpt = p if (p / "train_state.json").is_file() else latest_checkpoint(p)
        if ckpt is None:
            raise ConfigError(f"resume={cfg.resume}: neither a checkpoint folder (with train_state.json) nor a run "
                              "folder holding one")
    else:
        ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return None, None
    saved = read_train_state(ckpt)
    if "loader" not in saved or "config" not in saved:
        raise ConfigError(f"{ckpt} predates resumable checkpoints (no loader position); start a new run_dir "
                          f"with model.pretrained={ckpt}")
    old, new = flat_config(saved["config"]), flat_config(cfg.model_dump(mode="json"))
    diff = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k)
                  and k not in _RESUME_MAY_CHANGE and k.split(".")[0] not in _RESUME_MAY_CHANGE)
    if diff:
        what = "; ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in diff[:8])
        raise ConfigError(f"resuming {ckpt} with a different config ({what}). Use the saved config "
                          f"({run_dir / 'config.yaml'}) or a new run_dir")
    return ckpt, saved
