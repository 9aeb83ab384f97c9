"""What a run is made of (:class:`Run`) and what it counts as it goes (:class:`TrainState`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from mmpretrain.config import ExperimentConfig
from mmpretrain.data.image_input import ImageInput
from mmpretrain.data.position import StreamPosition
from mmpretrain.eval import Evaluator
from mmpretrain.losses import WeightedObjective
from mmpretrain.run_files import JsonlLog, RunFolder
from mmpretrain.train.schedule import Schedule
from mmpretrain.train.task import TrainingTask


@dataclass
class TrainState:
    """The counters a checkpoint restores besides weights, optimizer and RNG: optimizer steps taken,
    samples seen (all ranks), skipped steps, this rank's stream position, skipped samples by reason
    (this rank's since the start; after a resume the main process also holds the saved sums), and
    whether the run is still bit-exact."""

    position: StreamPosition
    step: int = 0
    samples: int = 0
    nonfinite_steps: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    exact: bool = True  # False once resumed from a checkpoint without its RNG states (not bit-exact)

    def saved(self, positions: list[dict[str, Any]], skipped: dict[str, int], epoch: int, schedule: dict[str, Any],
              config: dict[str, Any]) -> dict[str, Any]:
        """The state as ``train_state.json`` holds it (the checkpoint adds ``step`` and ``saved_at``):
        every rank's stream position (``loader[rank]``), the skipped samples summed over ranks, the
        schedule and the config trained with."""
        return {"samples": self.samples, "epoch": epoch, "schedule": schedule, "skipped": skipped, "loader": positions,
                "nonfinite_steps": self.nonfinite_steps, "exact_resume": self.exact, "config": config}

    def load(self, saved: dict[str, Any], main: bool) -> None:
        """The counters of a :meth:`saved` state (the stream position is loaded when it is made, before the
        loader); ``main``: the main process, which holds the skipped counts (sums over ranks)."""
        self.step, self.samples = saved["step"], saved["samples"]
        self.nonfinite_steps = saved.get("nonfinite_steps", 0)
        self.exact = bool(saved.get("exact_resume", True))  # once inexact (an RNG state was lost), for good
        if main:
            self.skipped.update(saved["skipped"])


@dataclass
class Run:
    cfg: ExperimentConfig
    accelerator: Accelerator
    model: torch.nn.Module  # the DualEncoder, prepared by accelerate
    objective: WeightedObjective
    optimizer: torch.optim.Optimizer
    loader: DataLoader | None
    schedule: Schedule
    files: RunFolder
    state: TrainState
    preprocess: Callable | None = None  # evaluation image transform and tokenizer, for the evaluator
    tokenizer: Callable | None = None
    evaluator: Evaluator | None = None
    log: JsonlLog | None = None  # main process only
    histograms: dict[str, list[float]] | None = None  # of the last diagnostics batch
    images: ImageInput = field(default_factory=ImageInput)  # batch -> model input (data/image_input.py)
    nonfinite: Any = None  # the non-finite step guard (train/nonfinite.py), made by the first train_step
    ema: Any = None  # train.ema: the weights' moving average (train/ema.py)
    task: TrainingTask | None = None  # what a step feeds the model and the objective (train/task.py)
    phase: Any = None  # train.phases: the phase this run trains (train/phases.py); None: one phase, the whole run

    def __post_init__(self):
        if self.task is None:  # the run's own parts
            self.task = TrainingTask(self.objective, self.images, ema=self.ema,
                                     text_length_multiple=self.cfg.train.text_length_multiple)

    def write(self, rec: dict[str, Any]) -> None:
        """A log record: log.jsonl and the trackers (main process)."""
        if self.log is not None and rec:
            self.log.write(rec)
            self.accelerator.log(numeric(rec), step=rec["step"])


def numeric(rec: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Flat ``name -> number`` for tensorboard/wandb (nested dicts become ``a/b``)."""
    out: dict[str, float] = {}
    for k, v in rec.items():
        if isinstance(v, dict):
            out.update(numeric(v, f"{prefix}{k}/"))
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
            out[prefix + k] = float(v)
    return out
