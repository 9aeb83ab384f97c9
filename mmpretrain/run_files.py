"""The run folder's format, in one place (docs/usage.md, training: the run folder).

``RUN/config.yaml`` (resolved config), ``model_config.json`` (open_clip ``model_cfg`` +
``preprocess_cfg``: the architecture as trained), ``provenance.json`` (git SHA, packages, command,
host, and the training data's manifests), ``log.jsonl``, ``results.json``, ``plots/`` and
``checkpoints/step_{N:08d}/``: accelerate's ``save_state`` (the model as ``model.safetensors``, its
keys those of :class:`~mmpretrain.models.factory.DualEncoder`, i.e. open_clip's under ``clip.``),
``train_state.json`` (written last: a folder without it is incomplete) and, for a stateful objective,
``objective.safetensors``. The newest complete checkpoint is the latest.

Readers (evaluation, export, ``model.pretrained``) and writers (the trainer, checkpoints) go through
:class:`RunFolder`; nothing here imports model or trainer code.
"""

from __future__ import annotations

import json
import platform
import re
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

PACKAGES = ("simpretrain", "torch", "torchvision", "open_clip_torch", "transformers", "sentence-transformers",
            "webdataset", "accelerate", "numpy")

CHECKPOINTS = "checkpoints"
MODEL_WEIGHTS = "model.safetensors"  # accelerate's save_state of the DualEncoder
TRAIN_STATE = "train_state.json"
OBJECTIVE_STATE = "objective.safetensors"
EMA_WEIGHTS = "ema.safetensors"  # train.ema's average of the trained parameters (names as the DualEncoder's)
CLIP_PREFIX = "clip."  # DualEncoder.clip: the open_clip model inside the trained module
_STEP_RE = re.compile(r"^step_(\d{8})$")


class RunFolder:
    """The files of one run folder (nothing is created until written)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.config = self.root / "config.yaml"
        self.model_config = self.root / "model_config.json"
        self.provenance = self.root / "provenance.json"
        self.log = self.root / "log.jsonl"
        self.results = self.root / "results.json"
        self.plots = self.root / "plots"
        self.checkpoints = self.root / CHECKPOINTS

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step_{step:08d}"

    def complete_checkpoints(self) -> list[Path]:
        """Complete ``checkpoints/step_N`` folders (with ``train_state.json``), oldest first."""
        if not self.checkpoints.is_dir():
            return []
        done = [p for p in self.checkpoints.iterdir() if _STEP_RE.match(p.name) and (p / TRAIN_STATE).is_file()]
        return sorted(done, key=lambda p: int(p.name[5:]))

    def latest_checkpoint(self) -> Path | None:
        done = self.complete_checkpoints()
        return done[-1] if done else None

    def is_run(self) -> bool:
        """A trained run: the architecture and a checkpoints folder."""
        return self.model_config.is_file() and self.checkpoints.is_dir()

    def write_model_config(self, model_cfg: dict, preprocess_cfg: dict) -> None:
        self.model_config.write_text(json.dumps({"model_cfg": model_cfg, "preprocess_cfg": preprocess_cfg}, indent=2))

    def read_model_config(self) -> tuple[dict, dict]:
        return read_open_clip_config(self.model_config)

    def read_json(self, path: Path) -> dict[str, Any]:
        return json.loads(path.read_text()) if path.is_file() else {}

    def log_records(self, up_to_step: int | None = None) -> list[dict[str, Any]]:
        """``log.jsonl``'s records (those of steps ``<= up_to_step``: later ones belong to an interrupted attempt)."""
        if not self.log.is_file():
            return []
        records = [json.loads(line) for line in self.log.read_text().splitlines() if line.strip()]
        return [r for r in records if up_to_step is None or r["step"] <= up_to_step]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete ``checkpoints/step_{N:08d}`` of a run folder."""
    return RunFolder(Path(run_dir)).latest_checkpoint()


def read_open_clip_config(path: Path) -> tuple[dict, dict]:
    """``(model_cfg, preprocess_cfg)`` of a ``model_config.json`` or an export's ``open_clip_config.json``."""
    data = json.loads(Path(path).read_text())
    return data["model_cfg"], data.get("preprocess_cfg", {})


def checkpoint_clip_weights(ckpt: Path) -> dict[str, Any]:
    """The open_clip model's weights in a checkpoint (the ``clip.`` prefix removed)."""
    state = load_file(str(Path(ckpt) / MODEL_WEIGHTS), device="cpu")
    return {k[len(CLIP_PREFIX):]: v for k, v in state.items() if k.startswith(CLIP_PREFIX)}


def git_sha(cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd or Path(__file__).parent, capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def provenance(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    versions = {}
    for pkg in PACKAGES:
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {
        "git_sha": git_sha(),
        "command": [sys.executable, *sys.argv],
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "packages": versions,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **(extra or {}),
    }


class JsonlLog:
    def __init__(self, path: Path, records: list[dict[str, Any]] | None = None):
        self.path = path
        self.records: list[dict[str, Any]] = list(records or [])

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def checkpoint_ema_weights(ckpt: Path) -> dict[str, Any] | None:
    """A checkpoint's weight average (train.ema), names as the dual encoder's, or None without one."""
    from safetensors.torch import load_file

    f = Path(ckpt) / EMA_WEIGHTS
    return load_file(str(f)) if f.is_file() else None
