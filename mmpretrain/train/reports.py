"""What the trainer reports: log records (terms averaged over ranks), geometry diagnostics of the
gathered batch (measured by :mod:`mmpretrain.train.diagnostics`), evaluations during training."""

from __future__ import annotations

import math
import time
from collections import Counter
from typing import Any

import torch
from accelerate.utils import gather_object

from mmpretrain.eval import merge_results
from mmpretrain.models.naflex import wrapped
from mmpretrain.train.diagnostics import GEOMETRY_ROWS, geometry, similarity_histogram
from mmpretrain.train.engine import full_weights
from mmpretrain.train.nonfinite import loss_terms
from mmpretrain.train.state import Run


def log_record(run: Run, terms: dict[str, torch.Tensor], loss: torch.Tensor, lr: float, since: float,
               samples: int, logit_scale: torch.Tensor | None = None) -> dict[str, Any]:
    """The record of the step just taken (``run.state.step``): every ``*_loss``/``*_unweighted`` term and
    the total, averaged over ranks; the objective's own diagnostics (``"regions/m5/q_entropy"``: keys
    with a ``/``, equal on every rank); learning rate, scale, throughput since ``since`` over ``samples``
    samples (all ranks), skipped samples by reason (all ranks)."""
    acc, st = run.accelerator, run.state
    keys = loss_terms(terms)
    vals = acc.reduce(torch.stack([terms[k].detach().float() for k in keys] + [loss.detach().float()])
                      .to(acc.device), reduction="mean").tolist()
    rec: dict[str, Any] = {"step": st.step, "samples": st.samples, "epoch": run.schedule.epoch_at(st.step), "lr": lr}
    rec.update({k: float(v) for k, v in zip(keys, vals)})
    rec["loss"] = float(vals[-1])
    for k, v in terms.items():
        if "/" in k and isinstance(v, torch.Tensor):
            v = v.detach().float().cpu()
            if v.numel() > 1:
                rec[k] = v.tolist()
            elif math.isfinite(float(v)):
                rec[k] = float(v)
    if logit_scale is not None:  # the forward's (under FSDP the parameter is sharded)
        rec["logit_scale"] = float(logit_scale)
    rec["samples_per_s"] = samples / max(time.time() - since, 1e-9)
    rec["skipped"] = all_ranks_skipped(acc, st.skipped)
    rec["nonfinite_steps"] = st.nonfinite_steps
    return rec


def all_ranks_skipped(accelerator, skipped: Counter) -> dict[str, int]:
    """Bad and dropped samples by reason, summed over ranks (call on every rank)."""
    total: Counter = Counter()
    for counts in gather_object([dict(skipped)]) if accelerator.num_processes > 1 else [skipped]:
        total.update(counts)
    return dict(sorted(total.items()))


def diagnostics(run: Run, features: tuple[torch.Tensor, torch.Tensor]) -> dict[str, float]:
    """Geometry of the global batch (every rank's features gathered; call on every rank)."""
    acc = run.accelerator
    # every rank's first rows, enough for the measures' GEOMETRY_ROWS (not the whole global batch)
    k = math.ceil(GEOMETRY_ROWS / acc.num_processes)
    x, y = (acc.gather(f[:k].float().contiguous()) for f in features)
    run.histograms = similarity_histogram(x, y)
    return {f"geometry/{k}": v for k, v in geometry(x, y).items()}


def evaluate(run: Run) -> dict[str, Any]:
    """The configured evaluations on every rank; results.json gets them under model ``step_N``."""
    with full_weights(run.accelerator, run.model) as module:
        entries = run.evaluator.run(wrapped(module.clip), run.preprocess, run.tokenizer, model_name=f"step_{run.state.step}")
    # the evaluator restored the open_clip model's train mode, which would put a locked (LiT) tower
    # back into dropout: the DualEncoder's train() puts it back in eval mode
    run.model.train()
    rec: dict[str, Any] = {"step": run.state.step}
    if run.cfg.train.phases:  # each phase evaluates at its own resolution: the log says which
        size = getattr(run.accelerator.unwrap_model(run.model).clip.visual, "image_size", None)
        rec.update(phase=run.phase.index + 1, eval_image_size=size[0] if isinstance(size, tuple) else size)
    for e in entries:
        for k, v in e["metrics"].items():
            rec[f"eval/{e['dataset']}/{k}"] = v
    if run.ema is not None:  # the averaged weights, scored beside the trained ones
        with run.ema.swapped_in(), full_weights(run.accelerator, run.model) as module:
            ema_entries = run.evaluator.run(wrapped(module.clip), run.preprocess, run.tokenizer,
                                            model_name=f"step_{run.state.step}_ema")
        run.model.train()
        for e in ema_entries:
            for k, v in e["metrics"].items():
                rec[f"eval_ema/{e['dataset']}/{k}"] = v
        entries = [*entries, *ema_entries]
    if run.accelerator.is_main_process:
        merge_results(run.files.results, entries)
    return rec
