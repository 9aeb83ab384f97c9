"""``train_step`` (one optimizer step: the training task's inputs, forward and backward, the update) and
``fit`` (the loop: log, diagnose, evaluate, checkpoint)."""

from __future__ import annotations

import json
import math
import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather_object
from tqdm import tqdm

from mmpretrain.data.batch import Batch
from mmpretrain.data.device_decode import Prefetcher
from mmpretrain.hub import push_folder
from mmpretrain.losses.base import is_term
from mmpretrain.train.checkpoint import save_checkpoint
from mmpretrain.train.diagnostics import plot_run
from mmpretrain.train.grad_cache import StepResult, forward_backward
from mmpretrain.train.nonfinite import NonFinite, nonfinite_verdict, terms_text
from mmpretrain.train.reports import all_ranks_skipped, diagnostics, evaluate, log_record
from mmpretrain.train.schedule import run_lr
from mmpretrain.train.state import Run


def train_step(run: Run, batch: Batch) -> StepResult:
    """One optimizer step on one batch; returns the objective's terms, the loss and this rank's features.
    A non-finite loss skips the update (``train.nonfinite=skip``) with zeroed terms, or raises
    FloatingPointError: decided on the device and read at the next log step, checkpoint or evaluation
    where the optimizer can skip an update on the device (:mod:`mmpretrain.train.nonfinite`), on the host
    at once elsewhere."""
    cfg, acc, st, sched = run.cfg, run.accelerator, run.state, run.schedule
    if run.nonfinite is None:
        run.nonfinite = NonFinite(acc, run.optimizer)
    guard = run.nonfinite
    lr = run_lr(st.step, cfg, sched, run.phase)
    for group in run.optimizer.param_groups:  # optim.layer_decay: each group its own share of the rate
        group["lr"] = lr * group.get("lr_scale", 1.0)
    inputs = run.task.inputs(batch, st.step, acc, run.model)
    res = forward_backward(acc, run.model, run.objective, inputs.images, inputs.tokens, inputs.target_embeddings,
                           micro_batch=cfg.train.micro_batch_size, mode=cfg.train.micro_batch_mode, finite=guard.agree,
                           context=inputs.context, **inputs.model_kw)
    res.terms["lr"] = lr
    if isinstance(res.finite, torch.Tensor):  # decided on the device: no host read until the next log step
        guard.record(st.step, res.finite, res.terms)
        apply_update(run, res.finite)
        zero_terms(res, res.finite)
    elif not res.finite:
        st.nonfinite_steps += 1
        nonfinite_verdict(st.step, terms_text(res.terms), st.nonfinite_steps, cfg)
        run.optimizer.zero_grad(set_to_none=True)
        run.objective.discard_step()
        zero_terms(res)
        return res
    else:
        apply_update(run)
    with torch.no_grad():
        acc.unwrap_model(run.model).clip.logit_scale.clamp_(0, math.log(cfg.train.max_logit_scale))
    return res


def apply_update(run: Run, ok: torch.Tensor | None = None) -> None:
    """The optimizer's sequence after a backward, in one place: the objective's proposed state committed,
    gradients clipped (``optim.grad_clip_norm``), the step, the gradients dropped. ``ok``: the device's
    0-dim verdict on the loss (fused AdamW then skips the update on the device where it is False); None:
    the loss is known finite."""
    acc, optimizer = run.accelerator, run.optimizer
    run.objective.commit_step(ok)  # state that moves only with accepted steps (global_clip's estimates)
    if run.cfg.optim.grad_clip_norm is not None:
        acc.clip_grad_norm_(run.model.parameters(), run.cfg.optim.grad_clip_norm)
    with run.nonfinite.skip_update(ok) if ok is not None else nullcontext():
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def zero_terms(res: StepResult, ok: torch.Tensor | None = None) -> None:
    """A skipped step's loss terms and loss as zeros (where ``ok`` is False, on the device; all when None)."""
    if ok is None:
        res.terms = {k: torch.zeros(()) if is_term(k) else v for k, v in res.terms.items()}
        res.loss = torch.zeros(())
        return
    zero = torch.zeros((), device=ok.device)
    res.terms = {k: torch.where(ok, v, zero) if is_term(k) and isinstance(v, torch.Tensor) else v
                 for k, v in res.terms.items()}
    res.loss = torch.where(ok, res.loss, zero)


def fit(run: Run) -> dict[str, Any]:
    """Train to the end of the run, or of its phase (``train.phases``): a boundary's checkpoint is taken, and
    the summary says ``phase_end``; :func:`mmpretrain.train.cli.main` sets the next phase up from it."""
    cfg, acc, st, sched = run.cfg, run.accelerator, run.state, run.schedule
    stop = run.phase.end if run.phase is not None else sched.total_steps
    run.model.train()
    bar = tqdm(total=sched.total_steps, initial=st.step, disable=not (acc.is_main_process and cfg.train.progress),
               desc="train", unit="step")
    # data.decode=device: each batch's JPEGs decoded on the device, one batch ahead on a background thread
    it = run.images.batches(run.loader)
    t0, last, last_step, last_samples = time.time(), time.time(), st.step, st.samples
    rec: dict[str, Any] = {}
    waited = 0.0  # seconds spent waiting for the loader since the last record (open_clip's data_time)
    try:
        while st.step < stop:
            t_wait = time.perf_counter()
            batch = next(it)
            waited += time.perf_counter() - t_wait
            st.skipped.update(batch.skipped)
            st.position.advance(batch)
            res = train_step(run, batch)
            st.step += 1
            if run.ema is not None:
                run.ema.update(st.step)
            st.samples += len(batch) * sched.world_size  # every rank the same size in a step (data.naflex: by step)
            bar.update(1)
            end = st.step == stop  # the run's or its phase's last step: logged, evaluated, checkpointed
            diag = bool(sched.diagnostics_every) and (st.step % sched.diagnostics_every == 0 or end)
            log = st.step % cfg.train.log_every == 0 or end or diag
            evaluating = run.evaluator is not None and (st.step % cfg.eval.every == 0 or end)
            saving = bool(cfg.train.save_every) and st.step % cfg.train.save_every == 0 and not end
            if log or evaluating or saving:  # the device's non-finite count, read (train.nonfinite may stop here)
                run.nonfinite.settle(st, cfg)
            if log:
                rec = log_record(run, res.terms, res.loss, res.terms["lr"], last, st.samples - last_samples,
                                 res.logit_scale)
                # this rank's (the main process's) wait for data: per step, and as a share of the interval
                rec["data_time"] = waited / max(1, st.step - last_step)
                rec["data_wait_fraction"] = min(1.0, waited / max(time.time() - last, 1e-9))
                waited = 0.0
                if diag:
                    rec.update(diagnostics(run, res.features))
                last, last_step, last_samples = time.time(), st.step, st.samples
                bar.set_postfix(loss=f"{rec['loss']:.3f}", scale=f"{rec['logit_scale']:.1f}",
                                samples_s=f"{rec['samples_per_s']:.0f}")
                run.write(rec)
            if evaluating:
                run.write(evaluate(run))
            if saving:
                checkpoint(run)
    finally:  # the decoding thread (data.decode=device) stops with the loop, however it ends
        if isinstance(it, Prefetcher):
            it.close()
    bar.close()
    ckpt = checkpoint(run)
    summary = {"steps": st.step, "samples": st.samples, "seconds": round(time.time() - t0, 1),
               "final": rec, "checkpoint": str(ckpt)}
    if st.step < sched.total_steps:  # a phase boundary: the next phase is set up from this checkpoint
        return dict(summary, phase_end=True)
    if run.log is not None and cfg.train.plots:
        plot_run(run.log.records, run.histograms, run.files.plots)
    if acc.is_main_process:
        print(json.dumps(summary))
    return summary


def checkpoint(run: Run) -> Path:
    """Save a checkpoint of the current step (every rank); ``hub.push_every``: upload it (main process)."""
    ckpt = save_checkpoint(run.accelerator, run.files, run.state.step, train_state_json(run), run.cfg.train.keep_last,
                           run.objective.state_dict(), run.model,
                           ema_state=run.ema.state_dict() if run.ema is not None else None)
    hub = run.cfg.hub
    if hub is not None and hub.push_every and run.state.step % hub.push_every == 0 and run.accelerator.is_main_process:
        push_folder(ckpt, hub.repo_id, private=hub.private, revision=hub.revision,
                    path_in_repo=f"checkpoints/{ckpt.name}", commit_message=f"checkpoint at step {run.state.step}")
    return ckpt


def train_state_json(run: Run) -> dict[str, Any]:
    """The train state as the checkpoint stores it (call on every rank): counters, every rank's
    stream position (``loader[rank]``) for an exact resume, and the config it was trained with."""
    st = run.state
    positions = [st.position.state()]
    if run.accelerator.num_processes > 1:
        positions = gather_object(positions)
    return st.saved(positions, all_ranks_skipped(run.accelerator, st.skipped), run.schedule.epoch_at(st.step),
                    asdict(run.schedule), run.cfg.model_dump(mode="json"))
