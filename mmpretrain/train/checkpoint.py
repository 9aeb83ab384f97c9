"""Checkpoints: ``accelerator.save_state`` for model/optimizer/RNG plus a JSON train state and, for a
stateful objective, its ``state_dict`` as safetensors; verifying them, choosing the one to resume from
(rank 0 chooses, every rank checks), the configs a resume refuses, and restoring the state.

Each checkpoint is written to ``checkpoints/step_{N:08d}.tmp`` and renamed when complete; the
newest folder holding ``train_state.json`` is the latest complete one (:mod:`mmpretrain.run_files`),
so a crash mid-write leaves the previous checkpoint as the one that loads. Objective state is not
saved through accelerate's custom-object checkpointing, which pickles.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import zipfile
from pathlib import Path
from pickle import UnpicklingError  # the exception only: nothing here unpickles but torch.load(weights_only)
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import load
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from mmpretrain.config import ConfigError, ExperimentConfig, config_defaults, flat_config
from mmpretrain.data.plan import StreamPlan
from mmpretrain.data.position import StreamPosition
from mmpretrain.losses import WeightedObjective
from mmpretrain.run_files import EMA_WEIGHTS, MODEL_WEIGHTS, OBJECTIVE_STATE, TRAIN_STATE, RunFolder
from mmpretrain.train.disk import CheckpointWriteError, disk_full, free_bytes
from mmpretrain.train.engine import SHARDED, engine_name, gathered_weights
from mmpretrain.train.state import TrainState

__all__ = ["Resume", "build_position", "check_layout", "check_resume", "checkpoint_layout", "choose_resume",
           "decide_resume", "load_objective_state", "read_train_state", "restore_state", "save_checkpoint",
           "verify_checkpoint"]


def save_checkpoint(accelerator, files: RunFolder, step: int, train_state: dict[str, Any], keep_last: int | None = None,
                    objective_state: dict[str, torch.Tensor] | None = None, model: torch.nn.Module | None = None,
                    ema_state: dict[str, torch.Tensor] | None = None) -> Path:
    """``objective_state``: the objective's ``state_dict`` (the same on every rank), written by the main
    process when not empty. Keeps the newest ``keep_last`` complete checkpoints.

    Under FSDP and DeepSpeed, accelerate's ``save_state`` writes the engine's own layout
    (``pytorch_model_fsdp.bin`` or ``pytorch_model_fsdp_0/``, DeepSpeed's ``pytorch_model/``), which a
    resume reads back; evaluation, export and ``model.pretrained`` read ``model.safetensors``, so the
    full fp32 weights of ``model`` (the prepared model) are gathered and written beside it, with the logit
    scale and bias 0-dim as open_clip has them. Every rank has finished writing before the main
    process renames the folder."""
    final = files.checkpoint(step)
    tmp = final.with_name(final.name + ".tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(tmp), safe_serialization=True)
        engine = engine_name(accelerator)
        if engine in SHARDED and model is not None:
            write_full_weights(accelerator, model, tmp, engine)
        accelerator.wait_for_everyone()  # no rank may still be writing into tmp when it is renamed
        if accelerator.is_main_process:
            if objective_state:
                save_file({k: v.detach().cpu().contiguous() for k, v in objective_state.items()},
                          str(tmp / OBJECTIVE_STATE))
            if ema_state is not None:  # train.ema (train/ema.py)
                save_file(ema_state, str(tmp / EMA_WEIGHTS))
            state = dict(train_state, step=step, saved_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
            (tmp / TRAIN_STATE).write_text(json.dumps(state, indent=2))
    except Exception as e:
        if not disk_full(e):
            raise
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)  # a partial checkpoint only takes the space back
        done = files.complete_checkpoints()
        kept = f"the last complete checkpoint, {done[-1]}, is intact" if done else "no earlier checkpoint exists"
        raise CheckpointWriteError(
            f"saving checkpoint step {step} to {tmp.parent}: no space left on the disk "
            f"({free_bytes(tmp.parent) / 2**20:,.0f} MiB free once the partial checkpoint is removed); {kept}. "
            "Free space (or lower train.keep_last) and run the same command again to resume") from None
    if accelerator.is_main_process:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        if keep_last:
            for old in files.complete_checkpoints()[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def write_full_weights(accelerator, model: torch.nn.Module, folder: Path, engine: str) -> None:
    """``folder/model.safetensors``: the full weights of an FSDP- or DeepSpeed-prepared model, gathered by
    the engine (:func:`~mmpretrain.train.engine.gathered_weights`; call on every rank)."""
    from mmpretrain.models.factory import scalar_logits

    state = gathered_weights(accelerator, model, folder, engine)
    if accelerator.is_main_process:
        save_file({k: v.detach().float().cpu().contiguous() if v.is_floating_point() else v.detach().cpu().contiguous()
                   for k, v in scalar_logits(state).items()}, str(folder / MODEL_WEIGHTS))




def checkpoint_layout(ckpt: Path) -> str:
    """Which engine's ``save_state`` wrote ``ckpt``: ``FSDP``, ``DeepSpeed`` or ``DDP`` (one process
    and DDP write the same files)."""
    names = {p.name for p in Path(ckpt).iterdir()} if Path(ckpt).is_dir() else set()
    if any(n.startswith("pytorch_model_fsdp") for n in names):
        return "FSDP"
    if "pytorch_model" in names and (Path(ckpt) / "pytorch_model").is_dir():
        return "DeepSpeed"
    return "DDP"


def check_layout(ckpt: Path, engine: str) -> None:
    """A resume reads the engine's own files: refuse a checkpoint another engine wrote, with the fix."""
    have = checkpoint_layout(ckpt)
    want = SHARDED.get(engine, "DDP")  # each sharding engine's save_state has its own layout
    if have != want:
        raise ConfigError(f"{ckpt} was written under {have}, this launch uses {want}: resume it with the same "
                          f"accelerate config, or start a new run_dir from its weights (model.pretrained={ckpt})")


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
_RESUME_MAY_CHANGE = {"resume", "run_dir", "name", "train.steps", "train.epochs", "train.progress", "train.plots", "train.log_every",
                      "train.save_every", "train.keep_last", "train.nonfinite", "train.max_skipped_steps",
                      "train.log_with", "train.diagnostics_every", "optim.implementation", "data.worker_nice", "eval",
                      "hub"}


def _zip_problem(path: Path, loads: bool = False) -> str | None:
    """torch.save writes zip archives (optimizer, RNG states): a truncated or damaged one fails its CRCs.
    ``loads``: the file is one accelerate's ``load_state`` reads with ``torch.load(weights_only=True)``;
    its pickle is unpickled the same way (memory-mapped: the tensors' bytes are not read), so one that
    holds other objects -- a foreign or tampered file -- is named here instead of failing the resume."""
    if not path.is_file():
        return "missing"
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
        if bad:
            return f"damaged member {bad}"
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        return f"unreadable ({e})"
    if loads:
        try:
            load(str(path), map_location="cpu", mmap=True)  # accelerate's loader: weights_only, its safe globals
        except UnpicklingError:
            return ("holds pickled objects other than tensors and plain values, refused for safety "
                    "(torch.load weights_only): not written by this trainer, or altered since")
        except (RuntimeError, OSError, EOFError, ValueError) as e:
            return f"unreadable ({e.__class__.__name__}: {str(e)[:200]})"
    return None


def verify_checkpoint(ckpt: Path, world_size: int | None = None) -> tuple[list[str], list[str]]:
    """``(problems, rng_problems)`` of a checkpoint folder, read without loading it: train_state.json
    parses and has a position, every safetensors header covers its file, every torch zip archive
    (optimizer, scheduler, scaler) passes its CRCs. ``rng_problems``: the per-process RNG states
    (``random_states_{rank}.pkl``) that are missing or damaged -- a resume without them still works but
    is not bit-exact."""
    ckpt = Path(ckpt)
    problems: list[str] = []
    try:
        state = json.loads((ckpt / TRAIN_STATE).read_text())
        if not isinstance(state, dict) or not {"step", "loader", "config"} <= state.keys():
            problems.append(f"{TRAIN_STATE}: not a train state (no step, loader or config)")
        elif world_size is None:
            world_size = len(state["loader"])
    except (OSError, ValueError) as e:
        problems.append(f"{TRAIN_STATE}: {e.__class__.__name__}: {e}")
    for p in sorted(ckpt.glob("*.safetensors")) + ([] if (ckpt / MODEL_WEIGHTS).exists() else [ckpt / MODEL_WEIGHTS]):
        try:
            with safe_open(str(p), "pt") as f:
                f.keys()
        except (SafetensorError, OSError) as e:
            problems.append(f"{p.name}: {'missing' if not p.exists() else e}")
    # FSDP's sharded state sits in pytorch_model_fsdp_0/ and optimizer_0/, DeepSpeed's in pytorch_model/
    archives = sorted(p for p in ckpt.rglob("*.bin")) + sorted(p for p in ckpt.rglob("*.pt"))
    if not any(p.name.startswith("optimizer") for p in (ckpt.iterdir() if ckpt.is_dir() else ())) and not any(
            p.name.endswith("optim_states.pt") for p in archives):
        problems.append("optimizer.bin: missing")
    for p in archives:  # those at the top level accelerate loads itself (DeepSpeed reads its own folder)
        if (why := _zip_problem(p, loads=p.parent == ckpt)) is not None:
            problems.append(f"{p.relative_to(ckpt)}: {why}")
    rng = [f"random_states_{r}.pkl: {why}" for r in range(world_size or 1)
           if (why := _zip_problem(ckpt / f"random_states_{r}.pkl", loads=True)) is not None]
    return problems, rng


class Resume:
    """Where a run continues from: the checkpoint and its train state (None: the start), whether the
    resume is bit-exact (the RNG states are there), and what was skipped on the way."""

    def __init__(self, ckpt: Path | None = None, saved: dict[str, Any] | None = None, exact: bool = True,
                 notes: list[str] | None = None):
        self.ckpt, self.saved, self.exact, self.notes = ckpt, saved, exact, notes or []


def choose_resume(resume: str | None, files: RunFolder, world_size: int) -> Resume:
    """The checkpoint to resume from: ``resume`` (a checkpoint, or a run folder: its newest intact one),
    else the run folder's newest intact checkpoint. Damaged ones are skipped with a note naming what is
    wrong; an explicitly named damaged checkpoint, or a folder whose checkpoints are all damaged or all
    incomplete, is refused with the fix."""
    if resume:
        p = Path(resume)
        if (p / TRAIN_STATE).is_file() or p.name.startswith("step_"):
            candidates, named = [p], True
        else:
            candidates, named = list(reversed(RunFolder(p).complete_checkpoints())), False
            if not candidates:
                raise ConfigError(f"resume={resume}: neither a checkpoint folder (with {TRAIN_STATE}) nor a run "
                                  "folder holding one")
    else:
        candidates, named = list(reversed(files.complete_checkpoints())), False
        if not candidates:
            steps = sorted(files.checkpoints.glob("step_[0-9]*[0-9]")) if files.checkpoints.is_dir() else []
            if steps:
                raise ConfigError(f"{files.checkpoints} holds {steps[-1].name} ({len(steps)} checkpoint folder(s)) "
                                  f"without {TRAIN_STATE}: incomplete or damaged. Remove them to start this run "
                                  "over, or give resume=PATH of an intact checkpoint")
            return Resume()
    notes = []
    for ckpt in candidates:
        problems, rng = verify_checkpoint(ckpt, world_size)
        if problems:
            if named:
                raise ConfigError(f"resume={resume}: the checkpoint is damaged ({'; '.join(problems[:4])}); "
                                  "resume from another one")
            notes.append(f"skipped {ckpt}: {'; '.join(problems[:4])}")
            continue
        if rng:
            notes.append(f"{ckpt}: {'; '.join(rng)}: the resume is not bit-exact (random streams restart)")
        return Resume(ckpt, read_train_state(ckpt), exact=not rng, notes=notes)
    raise ConfigError(f"every checkpoint in {files.checkpoints if not resume else resume} is damaged "
                      f"({'; '.join(notes[:3])}). Remove the damaged ones or start a new run_dir")


def check_resume(chosen: Resume, files: RunFolder, config: dict[str, Any]) -> tuple[Path | None, dict | None]:
    """The chosen checkpoint and its train state (``exact_resume: False`` when its RNG states are gone);
    a ``config`` (the run's, as JSON) that changes what it was trained with is refused, naming the keys."""
    ckpt, saved = chosen.ckpt, chosen.saved
    if ckpt is None:
        return None, None
    if "loader" not in saved or "config" not in saved:
        raise ConfigError(f"{ckpt} predates resumable checkpoints (no loader position); start a new run_dir "
                          f"with model.pretrained={ckpt}")
    # a key the checkpoint's config lacks (added since) counts as its default
    old, new = {**config_defaults(), **flat_config(saved["config"])}, flat_config(config)
    diff = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k)
                  and k not in _RESUME_MAY_CHANGE and k.split(".")[0] not in _RESUME_MAY_CHANGE)
    if diff:
        what = "; ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in diff[:8])
        raise ConfigError(f"resuming {ckpt} with a different config ({what}). Use the saved config "
                          f"({files.config}) or a new run_dir")
    if not chosen.exact:
        saved = dict(saved, exact_resume=False)
    return ckpt, saved


def decide_resume(acc: Accelerator, cfg: ExperimentConfig, files: RunFolder) -> tuple[Any, dict[str, Any] | None]:
    """Rank 0 picks the checkpoint to resume from (verifying it, skipping damaged ones) and every rank
    takes its choice, so that all resume from the same step -- or all refuse with the same message.

    A checkpoint inside the run folder travels as its name and each rank reads it from its own
    ``run_dir`` (the same path on a shared filesystem; each node's copy where run folders are per
    node). A rank that does not see it complete -- a node-local or lagging filesystem -- would resume
    from another step, or fail inside ``load_state``: every rank refuses instead, naming the rank."""
    choice: list[Any] = [None]
    if acc.is_main_process:
        try:
            chosen = choose_resume(cfg.resume, files, acc.num_processes)
            where = None
            if chosen.ckpt is not None:
                inside = chosen.ckpt.resolve().parent == files.checkpoints.resolve()
                where = ("name", chosen.ckpt.name) if inside else ("path", str(chosen.ckpt))
            choice = [(where, chosen.exact, chosen.notes, None)]
        except ConfigError as e:
            choice = [(None, True, [], str(e))]
    if acc.num_processes > 1:
        torch.distributed.broadcast_object_list(choice, src=0)
    where, exact, notes, error = choice[0]
    if error:
        raise ConfigError(error)
    path = None if where is None else files.checkpoints / where[1] if where[0] == "name" else Path(where[1])
    if acc.num_processes > 1:
        seen = [None] * acc.num_processes
        torch.distributed.all_gather_object(seen, path is None or (path / TRAIN_STATE).is_file())
        if not all(seen):
            ranks = [r for r, ok in enumerate(seen) if not ok]
            raise ConfigError(f"rank 0 resumes from {path}, which rank(s) {ranks} do not see (no {TRAIN_STATE} "
                              "there): run_dir must be on a filesystem every node shares, with the same path "
                              "(or copy the checkpoint to every node's run_dir, or give resume=PATH that all see)")
    if acc.is_main_process:
        for note in notes:
            print(f"warning: {note}", file=sys.stderr)
    chosen = Resume(path, read_train_state(path), exact, notes) if path else Resume()
    return check_resume(chosen, files, cfg.model_dump(mode="json"))


def build_position(plan: StreamPlan, saved: dict[str, Any] | None, rank: int, world_size: int, ckpt) -> StreamPosition:
    """This rank's stream position: the start, or the checkpoint's (same ranks and plan, else refused)."""
    position = StreamPosition(plan)
    if saved is None:
        return position
    if len(saved["loader"]) != world_size:
        raise ConfigError(f"{ckpt} was written by {len(saved['loader'])} process(es), this run has {world_size}: an "
                          "exact resume needs the same number (or start anew with model.pretrained=CHECKPOINT)")
    try:
        position.load(saved["loader"][rank])
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return position


def restore_state(acc: Accelerator, objective: WeightedObjective, state: TrainState, files: RunFolder, ckpt,
                  saved: dict[str, Any]) -> list[dict[str, Any]]:
    """Weights, optimizer and RNG (accelerate's ``load_state``: safetensors and ``torch.load(weights_only)``),
    the objective's state and the counters (the stream position is restored before the loader is
    built: :func:`build_position`). Returns the log records up to the checkpoint: later ones belong
    to the interrupted attempt."""
    acc.load_state(str(ckpt))
    if objective.state_dict():
        load_objective_state(objective, ckpt)
    state.load(saved, acc.is_main_process)
    return files.log_records(up_to_step=saved["step"])
