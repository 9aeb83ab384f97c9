"""``train.ema``: an exponential moving average of the trained weights (timm's ModelEma; in neither
open_clip release). After every ``every``-th optimizer step ``s``:

    ema <- decay x ema + (1 - decay) x weights        (s > warmup_steps)
    ema <- weights                                     (s <= warmup_steps: a copy, while the weights move fast)

in fp32 on the weights' device, over the parameters that train (frozen ones are the model's own), on
the training thread without a host read. Under DDP every rank holds the same weights and so the same
average; the main process saves it into each checkpoint as ``ema.safetensors`` (parameter names as the
model's), a resume loads it back (bit-identical), evaluation during training scores it beside the raw
weights, and ``mmpretrain.export RUN --ema`` exports it. FSDP and DeepSpeed shard the weights, so each
rank would average only its shard and the checkpoint would need the engine's gather: refused there.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
from torch import nn

from mmpretrain.config import ConfigError, ExperimentConfig
from mmpretrain.models.factory import pre_projection
from mmpretrain.run_files import EMA_WEIGHTS
from mmpretrain.train.engine import sharded_engine

__all__ = ["EMA", "EMA_FILE", "make_ema"]

EMA_FILE = EMA_WEIGHTS


class EMA:
    def __init__(self, module: nn.Module, decay: float, every: int = 1, warmup_steps: int = 0):
        self.names = [n for n, p in module.named_parameters() if p.requires_grad]
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.shadow = [p.detach().float().clone() for p in self.params]
        self.decay, self.every, self.warmup_steps = decay, every, warmup_steps

    @torch.no_grad()
    def update(self, step: int) -> None:
        """After optimizer step ``step`` (1-based)."""
        if step % self.every:
            return
        if step <= self.warmup_steps:
            for s, p in zip(self.shadow, self.params):
                s.copy_(p.detach())
            return
        w = 1.0 - self.decay
        for s, p in zip(self.shadow, self.params):
            s.lerp_(p.detach().float(), w)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: s.detach().cpu().contiguous() for n, s in zip(self.names, self.shadow)}

    def load(self, path: Path) -> None:
        from safetensors.torch import load_file

        saved = load_file(str(path))
        missing = [n for n in self.names if n not in saved]
        if missing:
            raise ValueError(f"{path} holds no average of {len(missing)} trained parameter(s), e.g. {missing[0]}: "
                             "it was written for another set of trained parameters")
        from mmpretrain.models.positions import fit_positions

        with torch.no_grad():
            for n, s in zip(self.names, self.shadow):
                v = saved[n]
                if n.endswith("visual.positional_embedding"):  # train.phases: maybe saved on another grid
                    v = fit_positions(v, s.shape[0])
                s.copy_(v.reshape(s.shape))

    @torch.no_grad()
    def encodings(self, model: nn.Module, images: torch.Tensor) -> torch.Tensor:
        """The image tower's pre-projection outputs under the averaged weights (ReSA's momentum encoder),
        without copying them into the model: the tower is called with the average in place of its trained
        parameters (its frozen ones are its own)."""
        prefix = "clip.visual."
        params = {"visual." + n[len(prefix):]: s.to(p.dtype) for n, s, p in zip(self.names, self.shadow, self.params)
                  if n.startswith(prefix) and n != prefix + "proj"}
        return torch.func.functional_call(_PreProjection(model.clip.visual), params, (images,))

    @torch.no_grad()
    def call(self, wrapper: nn.Module, *args):
        """``wrapper(*args)`` with the average in place of the trained parameters of ``wrapper.model`` (the
        unwrapped dual encoder; its frozen ones are its own): the self-supervised terms' teacher."""
        params = {"model." + n: s.to(p.dtype) for n, s, p in zip(self.names, self.shadow, self.params)}
        return torch.func.functional_call(wrapper, params, args)

    @contextlib.contextmanager
    def swapped_in(self):
        """The averaged weights in the model for the block (evaluation), the trained ones back after."""
        backup = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, s in zip(self.params, self.shadow):
                p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, b in zip(self.params, backup):
                    p.copy_(b)


class _PreProjection(nn.Module):
    """The image tower's output before its projection, as a module ``functional_call`` can swap weights in."""

    def __init__(self, visual: nn.Module):
        super().__init__()
        self.visual = visual

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return pre_projection(self.visual, images)


def make_ema(cfg: ExperimentConfig, acc, module: nn.Module, ckpt) -> EMA | None:
    """``train.ema``: the average of the prepared model's trained weights, loaded from ``ckpt`` on a resume;
    refused under FSDP and DeepSpeed (each rank holds a shard of the weights)."""
    if cfg.train.ema is None:
        return None
    engine = sharded_engine(acc)
    if engine is not None:
        raise ConfigError(f"train.ema under {engine}: each rank holds a shard of "
                          "the weights, so an average here would cover a shard and need the engine's gather to save; "
                          "not supported. Train with data parallelism (configs/accelerate/8gpu.yaml) or drop train.ema")
    e = cfg.train.ema
    ema = EMA(acc.unwrap_model(module), e.decay, e.every, e.warmup_steps)
    if ckpt is not None:
        if (ckpt / EMA_FILE).is_file():
            try:
                ema.load(ckpt / EMA_FILE)
            except ValueError as err:
                raise ConfigError(f"train.ema: {err}") from None
        elif acc.is_main_process:
            print(f"note: {ckpt} holds no weight average (train.ema was off): the average starts from the resumed "
                  "weights", file=sys.stderr)
    return ema
