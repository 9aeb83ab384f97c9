"""Disk space for checkpoints: what one checkpoint of a model takes, the start-of-run check that the run
folder's disk holds it (and a note when it cannot hold the ``train.keep_last + 1`` that coexist while the
newest is written), and telling a full disk from other write errors, which each writer words its own way."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from mmpretrain.run_files import RunFolder
from mmpretrain.train.engine import SHARDED

__all__ = ["CheckpointWriteError", "check_disk", "checkpoint_bytes", "disk_full", "free_bytes"]


class CheckpointWriteError(OSError):
    """A checkpoint could not be written for want of disk space (the CLI prints it as one line, exit 1)."""


def disk_full(e: BaseException) -> bool:
    """Whether ``e`` says the disk or quota is full: ``OSError`` carries the errno, safetensors' and torch's
    writers only the OS message."""
    import errno

    return getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or any(
        m in str(e) for m in ("No space left on device", "Disk quota exceeded", "os error 28", "os error 122"))


def free_bytes(path: Path) -> int:
    """Free bytes on the disk that holds ``path`` (its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def checkpoint_bytes(module: torch.nn.Module, engine: str = "DDP") -> tuple[int, int]:
    """(model bytes, optimizer bytes) of one checkpoint of ``module`` (before ``prepare``): every tensor
    of its state dict as stored, and AdamW's two fp32 moments of each trainable parameter. Under FSDP and
    DeepSpeed the engine's sharded layout sums to the same, and the gathered fp32 ``model.safetensors``
    is written beside it (counted in the model bytes)."""
    model = sum(t.numel() * t.element_size() for t in module.state_dict().values())
    optimizer = 8 * sum(p.numel() for p in module.parameters() if p.requires_grad)
    if engine in SHARDED:
        model += 4 * sum(t.numel() for t in module.state_dict().values() if t.is_floating_point())
    return model, optimizer


def check_disk(files: RunFolder, module: torch.nn.Module, keep_last: int, engine: str = "DDP",
               free: int | None = None) -> str | None:
    """Raise ``CheckpointWriteError`` when the disk holding the run folder cannot hold one checkpoint;
    return a note when it cannot hold the ``keep_last + 1`` checkpoints that coexist while the newest is
    written (the oldest is removed only after it), else None. ``free``: the free bytes (default: read)."""
    model, optim = checkpoint_bytes(module, engine)
    need = model + optim
    free = free_bytes(files.root) if free is None else free
    gib = 2**30
    if free < need:
        raise CheckpointWriteError(
            f"run_dir={files.root}: its disk has {free / gib:.2f} GiB free and one checkpoint needs "
            f"~{need / gib:.2f} GiB (weights {model / gib:.2f} + AdamW state {optim / gib:.2f}): free space there "
            "or set run_dir to a larger disk")
    if free < need * (keep_last + 1):
        return (f"run_dir={files.root} has {free / gib:.2f} GiB free: room for {free // need} checkpoint(s) of "
                f"~{need / gib:.2f} GiB, and train.keep_last={keep_last} keeps {keep_last + 1} while the newest "
                "is written; a save that runs out of space stops the run (the last complete checkpoint stays): "
                "lower train.keep_last or free space")
    return None
