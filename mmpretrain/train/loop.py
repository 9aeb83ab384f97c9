"""``train_step`` (one optimizer step) and ``fit`` (the loop: log, diagnose, evaluate, checkpoint)."""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather_object
from tqdm import tqdm

from mmpretrain.data.device_decode import Prefetcher
from mmpretrain.hub import push_folder
from mmpretrain.models.factory import trim_padding
from mmpretrain.train.checkpoint import save_checkpoint
from mmpretrain.train.diagnostics import plot_run
from mmpretrain.train.grad_cache import StepResult, forward_backward
from mmpretrain.train.nonfinite import NonFinite
from mmpretrain.train.reports import all_ranks_skipped, diagnostics, evaluate, log_record
from mmpretrain.train.schedule import lr_at
from mmpretrain.train.state import Run


def step_context(objective, step: int, batch: dict[str, Any], device: torch.device,
                 teacher_dims: list[int] | None = None) -> dict[str, Any]:
    """What the objective's forward receives besides the features: ``step``, ``epoch`` (1-based, the
    stream epoch the batch belongs to) and the per-sample inputs it declares it needs."""
    context: dict[str, Any] = {"step": step, "epoch": int(batch["epoch"]) + 1}
    if objective.needs_labels:
        context["labels"] = batch["labels"].to(device, non_blocking=True)
    if getattr(objective, "needs_negatives", False):
        context["negative_mask"] = batch["negative_mask"].to(device, non_blocking=True)
    if objective.needs_sample_index:
        context["sample_index"] = batch["sample_index"].to(device, non_blocking=True)
    if getattr(objective, "needs_teacher", False):  # the stored teacher rows of the crops and captions trained on
        for key in ("teacher_image_embeddings", "teacher_text_embeddings"):
            context[key] = batch[key].to(device, non_blocking=True)
        context["teacher_dims"] = teacher_dims
    return context


def train_step(run: Run, batch: dict[str, Any]) -> StepResult:
    """One optimizer step on one batch (``batch["epoch"]``: its 0-based stream epoch); returns the
    objective's terms, the loss and this rank's features. A non-finite loss skips the update
    (``train.nonfinite=skip``) with zeroed terms, or raises FloatingPointError: decided on the device
    and read at the next log step, checkpoint or evaluation where the optimizer can skip an update on
    the device (:mod:`mmpretrain.train.nonfinite`), on the host at once elsewhere."""
    cfg, acc, st, sched = run.cfg, run.accelerator, run.state, run.schedule
    if run.nonfinite is None:
        run.nonfinite = NonFinite(acc, run.optimizer)
    guard = run.nonfinite
    lr = lr_at(st.step, base_lr=cfg.optim.lr, warmup_steps=sched.warmup_steps, total_steps=sched.total_steps,
               min_lr_ratio=cfg.optim.min_lr_ratio)
    for group in run.optimizer.param_groups:  # optim.layer_decay: each group its own share of the rate
        group["lr"] = lr * group.get("lr_scale", 1.0)
    images = run.images(batch, acc.device)
    target_emb = batch.get("target_embeddings")
    if run.target_encoder is not None:
        with torch.no_grad():
            target_emb = run.target_encoder.encode(batch["texts"], convert_to_tensor=True, normalize_embeddings=True)
    if target_emb is not None:
        target_emb = target_emb.to(acc.device, non_blocking=True).float()
    tokens, negative_tokens = batch.get("tokens"), None
    if tokens is not None:
        if getattr(run.objective, "needs_negatives", False):  # one text pass: cut to the longer of the two
            negative_tokens = batch["negative_tokens"]
            both = torch.cat([tokens, negative_tokens])
            both = trim_padding(both, cfg.train.text_length_multiple) if run.trim_text else both
            tokens, negative_tokens = both[:len(tokens)], both[len(tokens):].to(acc.device, non_blocking=True)
        elif run.trim_text:  # on the host copy: the used length read on the device would be a sync
            tokens = trim_padding(tokens, cfg.train.text_length_multiple)
        tokens = tokens.to(acc.device, non_blocking=True)
    context = step_context(run.objective, st.step, batch, acc.device, run.teacher_dims)
    encodings_from = getattr(run.objective, "image_encodings_from", None)
    if encodings_from == "ema":  # ReSA's momentum encoder: the weight average's image tower, no gradient
        with acc.autocast():
            context["image_encodings"] = run.ema.encodings(acc.unwrap_model(run.model), images)
    res = forward_backward(acc, run.model, run.objective, images, tokens, target_emb, negative_tokens=negative_tokens,
                           encodings=encodings_from == "online", micro_batch=cfg.train.micro_batch_size,
                           mode=cfg.train.micro_batch_mode, finite=guard.agree, context=context)
    res.terms["lr"] = lr
    if isinstance(res.finite, torch.Tensor):  # decided on the device: no host read until the next log step
        ok = res.finite
        guard.record(st.step, ok, res.terms)
        run.objective.commit_step(ok)  # state that moves only with accepted steps (global_clip's estimates)
        if cfg.optim.grad_clip_norm is not None:
            acc.clip_grad_norm_(run.model.parameters(), cfg.optim.grad_clip_norm)
        with guard.skip_update(ok):  # fused AdamW leaves everything as it was when the loss was not finite
            run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        zero = torch.zeros((), device=ok.device)
        res.terms = {k: torch.where(ok, v, zero) if k.endswith(("_loss", "_unweighted")) and isinstance(v, torch.Tensor)
                     else v for k, v in res.terms.items()}
        res.loss = torch.where(ok, res.loss, zero)
    elif not res.finite:
        terms = ", ".join(f"{k}={float(v):.4g}" for k, v in res.terms.items() if k.endswith(("_loss", "_unweighted")))
        st.nonfinite_steps += 1
        if cfg.train.nonfinite == "stop" or st.nonfinite_steps > cfg.train.max_skipped_steps:
            raise FloatingPointError(f"non-finite loss at step {st.step} ({terms}); the last checkpoint holds the "
                                     "state before it (train.nonfinite=skip skips such steps)")
        print(f"warning: non-finite loss at step {st.step} ({terms}): step skipped "
              f"({st.nonfinite_steps}/{cfg.train.max_skipped_steps})", file=sys.stderr)
        run.optimizer.zero_grad(set_to_none=True)
        run.objective.discard_step()
        res.terms = {k: torch.zeros(()) if k.endswith(("_loss", "_unweighted")) else v for k, v in res.terms.items()}
        res.loss = torch.zeros(())
        return res
    else:
        run.objective.commit_step()
        if cfg.optim.grad_clip_norm is not None:
            acc.clip_grad_norm_(run.model.parameters(), cfg.optim.grad_clip_norm)
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        acc.unwrap_model(run.model).clip.logit_scale.clamp_(0, math.log(cfg.train.max_logit_scale))
    return res


def fit(run: Run) -> dict[str, Any]:
    cfg, acc, st, sched = run.cfg, run.accelerator, run.state, run.schedule
    run.model.train()
    bar = tqdm(total=sched.total_steps, initial=st.step, disable=not (acc.is_main_process and cfg.train.progress),
               desc="train", unit="step")
    # data.decode=device: each batch's JPEGs decoded on the device, one batch ahead on a background thread
    it = run.images.batches(run.loader)
    t0, last, last_step = time.time(), time.time(), st.step
    rec: dict[str, Any] = {}
    waited = 0.0  # seconds spent waiting for the loader since the last record (open_clip's data_time)
    try:
        while st.step < sched.total_steps:
            t_wait = time.perf_counter()
            batch = next(it)
            waited += time.perf_counter() - t_wait
            st.skipped.update(batch["skipped"])
            st.position.advance(batch)
            res = train_step(run, batch)
            st.step += 1
            if run.ema is not None:
                run.ema.update(st.step)
            st.samples += sched.global_batch_size
            bar.update(1)
            end = st.step == sched.total_steps
            diag = bool(sched.diagnostics_every) and (st.step % sched.diagnostics_every == 0 or end)
            log = st.step % cfg.train.log_every == 0 or end or diag
            evaluating = run.evaluator is not None and (st.step % cfg.eval.every == 0 or end)
            saving = bool(cfg.train.save_every) and st.step % cfg.train.save_every == 0 and not end
            if log or evaluating or saving:  # the device's non-finite count, read (train.nonfinite may stop here)
                run.nonfinite.settle(st, cfg)
            if log:
                rec = log_record(run, res.terms, res.loss, res.terms["lr"], last, st.step - last_step, res.logit_scale)
                # this rank's (the main process's) wait for data: per step, and as a share of the interval
                rec["data_time"] = waited / max(1, st.step - last_step)
                rec["data_wait_fraction"] = min(1.0, waited / max(time.time() - last, 1e-9))
                waited = 0.0
                if diag:
                    rec.update(diagnostics(run, res.features))
                last, last_step = time.time(), st.step
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
    if run.log is not None:
        plot_run(run.log.records, run.histograms, run.files.plots)
    summary = {"steps": st.step, "samples": st.samples, "seconds": round(time.time() - t0, 1),
               "final": rec, "checkpoint": str(ckpt)}
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
    return {"samples": st.samples, "epoch": run.schedule.epoch_at(st.step), "schedule": asdict(run.schedule),
            "skipped": all_ranks_skipped(run.accelerator, st.skipped), "loader": positions,
            "nonfinite_steps": st.nonfinite_steps, "exact_resume": st.exact, "config": run.cfg.model_dump(mode="json")}
