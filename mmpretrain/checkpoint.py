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
from typing import Any

from mmpretrain.models.factory import latest_checkpoint

__all__ = ["save_checkpoint", "latest_checkpoint", "read_train_state"]


def save_checkpoint(accelerator, run_dir: Path, step: int, train_state: dict[str, Any]) -> Path:
    final = Path(run_dir) / "checkpoints" / f"step_{step:08d}"
    tmp = final.with_name(final.name + ".tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp), safe_serialization=True)
    if accelerator.is_main_process:
        state = dict(train_state, step=step, saved_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        (tmp / "train_state.json").write_text(json.dumps(state, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    accelerator.wait_for_everyone()
    return final


def read_train_state(ckpt: Path) -> dict[str, Any]:
    return json.loads((Path(ckpt) / "train_state.json").read_text())
