"""Which process this is, for the entry points that do not own an ``Accelerator`` (evaluation, the data
tools). The one place rank and world size are read; the library below takes them as arguments.

Under ``accelerate launch`` or ``torchrun`` (``WORLD_SIZE`` > 1) accelerate's ``PartialState``
initialises the process group (gloo on CPU, NCCL on GPUs), as it would for the trainer; otherwise
this is process 0 of 1 and nothing distributed is started.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Process:
    rank: int = 0
    world_size: int = 1
    device: str = "cpu"
    state: Any = None  # accelerate.PartialState when launched with several processes

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.state is not None:
            self.state.wait_for_everyone()


def current_process() -> Process:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # accelerate costs ~2 s to import: only launched (multi-process) runs pay for it
        from accelerate import PartialState

        state = PartialState(cpu=not torch.cuda.is_available())
        return Process(state.process_index, state.num_processes, str(state.device), state)
    return Process(0, 1, "cuda" if torch.cuda.is_available() else "cpu")
