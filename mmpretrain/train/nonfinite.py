"""Non-finite losses (``train.nonfinite``) decided without waiting for the device between log steps.

Every rank must take the same decision, so the flag is all-reduced; reading it on the host each step
would make the host wait for each forward and backward before it can queue the next step. Where the
optimizer can skip an update on the device -- torch's fused AdamW takes ``found_inf`` and leaves the
parameters, moments and step count untouched when it is 1, exactly as torch's GradScaler uses it --
the step runs whatever the flag, the backward included (its gradients are discarded with the update),
and :class:`NonFinite` keeps on the device how many steps were skipped, the first one's step number and
its terms. :meth:`NonFinite.settle` reads them (one host read) at each log step and before every
checkpoint and evaluation: ``train.nonfinite=stop`` raises there naming the step, ``skip`` warns and
counts, up to ``train.max_skipped_steps``.

Elsewhere the decision is read on the host each step, as before: the foreach and for-loop AdamW kernels
refuse ``found_inf`` (torch asserts it is None), fp16 runs under accelerate's GradScaler (which owns
``found_inf``), and DeepSpeed's engine steps its own optimizer.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from mmpretrain.losses.base import is_term
from mmpretrain.train.engine import engine_name


def inner_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's wrapper(s)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def skips_on_device(accelerator, optimizer) -> bool:
    """Whether a non-finite step can be skipped on the device (fused AdamW, not fp16, not DeepSpeed)."""
    inner = inner_optimizer(optimizer)
    return (isinstance(inner, torch.optim.Adam) and bool(inner.defaults.get("fused"))
            and str(accelerator.mixed_precision) != "fp16" and engine_name(accelerator) != "DEEPSPEED")


def loss_terms(terms: dict[str, Any]) -> list[str]:
    """The loss terms' keys (:func:`~mmpretrain.losses.base.is_term`) among a step's outputs, sorted."""
    return sorted(k for k in terms if is_term(k) and isinstance(terms[k], torch.Tensor))


class NonFinite:
    """The run's non-finite steps, counted on the device (``on_device``) or decided on the host."""

    def __init__(self, accelerator, optimizer):
        self.accelerator = accelerator
        self.on_device = skips_on_device(accelerator, optimizer)
        self.optimizer = inner_optimizer(optimizer)
        device = accelerator.device
        self.count = torch.zeros((), dtype=torch.long, device=device)  # skipped since the last settle
        self.first = torch.full((), -1, dtype=torch.long, device=device)  # the first of them
        self.keys: list[str] = []
        self.terms: torch.Tensor | None = None  # the first one's terms

    def agree(self, loss: torch.Tensor) -> torch.Tensor | bool:
        """Whether the loss is finite on every rank (one all-reduce): a 0-dim bool tensor on the device, or
        a bool read on the host when the step cannot be skipped on the device."""
        bad = (~torch.isfinite(loss.detach())).float().reshape(1)
        acc = self.accelerator
        if acc.num_processes > 1:
            bad = acc.reduce(bad.to(acc.device), reduction="sum")
        if not self.on_device:
            return not bad.item()
        return bad[0] == 0

    def record(self, step: int, ok: torch.Tensor, terms: dict[str, Any]) -> None:
        """Count a step whose loss may be non-finite (on the device), keeping the first one's terms."""
        keys = loss_terms(terms)
        values = torch.stack([terms[k].detach().float().reshape(()).to(ok.device) for k in keys]) if keys else None
        if keys != self.keys or self.terms is None:  # the first step, or an objective whose terms change
            self.keys, self.terms = keys, None if values is None else torch.zeros_like(values)
        new = ~ok & (self.first < 0)
        self.first = torch.where(new, step, self.first)
        if values is not None:
            self.terms = torch.where(new, values, self.terms)
        self.count += (~ok).long()

    def skip_update(self, ok: torch.Tensor):
        """Context for ``optimizer.step()``: the fused kernel skips the update when ``ok`` is False."""
        return _FoundInf(self.optimizer, (~ok).float())

    def settle(self, state, cfg) -> None:
        """Read the device's count (one host read): raise FloatingPointError under ``train.nonfinite=stop``
        or past ``train.max_skipped_steps``, else warn. Call on every rank at the same steps."""
        if not self.on_device:
            return
        head = torch.stack([self.count, self.first]).tolist()
        count, first = int(head[0]), int(head[1])
        if not count:
            return
        values = self.terms.tolist() if self.terms is not None else []
        terms = ", ".join(f"{k}={v:.4g}" for k, v in zip(self.keys, values))
        self.count.zero_()
        self.first.fill_(-1)
        state.nonfinite_steps += count
        nonfinite_verdict(first, terms, state.nonfinite_steps, cfg, count - 1)


def terms_text(terms: dict[str, Any]) -> str:
    """A step's loss terms as the non-finite message names them (``clip_loss=nan, ...``)."""
    return ", ".join(f"{k}={float(terms[k]):.4g}" for k in loss_terms(terms))


def nonfinite_verdict(step: int, terms: str, skipped: int, cfg, more: int = 0) -> None:
    """The non-finite rule, in one place: raise FloatingPointError under ``train.nonfinite=stop`` or once
    ``skipped`` (the run's non-finite steps so far) is past ``train.max_skipped_steps``; else warn. ``step``:
    the first non-finite step, ``terms`` its loss terms, ``more``: non-finite steps after it."""
    since = f" and {more} more step(s) after it" if more else ""
    if cfg.train.nonfinite == "stop" or skipped > cfg.train.max_skipped_steps:
        raise FloatingPointError(f"non-finite loss at step {step} ({terms}){since}; the last checkpoint holds the "
                                 "state before it (train.nonfinite=skip skips such steps)")
    print(f"warning: non-finite loss at step {step} ({terms}){since}: step(s) skipped "
          f"({skipped}/{cfg.train.max_skipped_steps})", file=sys.stderr)


class _FoundInf:
    def __init__(self, optimizer, flag: torch.Tensor):
        self.optimizer, self.flag = optimizer, flag

    def __enter__(self):
        self.optimizer.found_inf = self.flag

    def __exit__(self, *exc):
        del self.optimizer.found_inf
