"""The trainer: ``python -m mmpretrain.train --config FILE [a.b=value ...]``, or
``accelerate launch -m mmpretrain.train ...``.

``setup(cfg) -> Run`` (:mod:`~mmpretrain.train.run_setup`) builds everything from a validated config and
restores a checkpoint; ``train_step(run, batch)`` is one optimizer step and ``fit(run)`` the loop
(:mod:`~mmpretrain.train.loop`); :mod:`~mmpretrain.train.state` holds ``Run`` and ``TrainState``;
:mod:`~mmpretrain.train.cli` the command line.

This package's ``__init__`` only names them: the trainer's modules import torch, accelerate and
open_clip (~5 s), which ``python -m mmpretrain.train --help`` should not wait for, so they load on
first use of these names.
"""

from __future__ import annotations

from mmpretrain.train.cli import main

__all__ = ["Run", "TrainState", "fit", "main", "setup", "train_step"]


def __getattr__(name: str):
    if name == "setup":
        from mmpretrain.train.run_setup import setup

        return setup
    if name in ("train_step", "fit"):
        from mmpretrain.train import loop

        return getattr(loop, name)
    if name in ("Run", "TrainState"):
        from mmpretrain.train import state

        return getattr(state, name)
    raise AttributeError(f"module 'mmpretrain.train' has no attribute {name!r}")
