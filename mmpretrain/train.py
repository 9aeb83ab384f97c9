"""Pretraining entry point: ``python -m mmpretrain.train --config FILE [a.b=value ...]``.

Also ``accelerate launch -m mmpretrain.train ...``. ``setup`` builds everything from a validated
config, ``train_step`` is one optimizer step, ``fit`` loops, logs and checkpoints. Exit codes:
0 success, 1 the work failed, 2 bad arguments or config (before any work).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mmpretrain.config import ConfigError, ExperimentConfig, load_config, resolve_schedule, to_yaml


@dataclass
class Run:
    cfg: ExperimentConfig
    accelerator: Any
    model: Any
    objective: Any
    optimizer: Any
    loader: Any
    schedule: dict[str, int]
    run_dir: Path
    target_encoder: Any = None
    log: Any = None
    step: int = 0
    samples: int = 0
    skipped: Counter = field(default_factory=Counter)


def setup(cfg: ExperimentConfig) -> Run:
    """Everything a run needs; raises ConfigError (exit 2) before any compute when the config cannot run."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from mmpretrain.data.shards import (
        SampleDecoder,
        ShardStream,
        check_shard_count,
        make_loader,
        resolve_shards,
    )
    from mmpretrain.losses import NEEDS_TARGETS, build_objective
    from mmpretrain.models import factory
    from mmpretrain.models.target_encoder import load_target_encoder, target_plan
    from mmpretrain.run_files import JsonlLog, provenance
    from mmpretrain.schedule import param_groups

    if cfg.train.precision != "no" and not torch.cuda.is_available():
        raise ConfigError(f"train.precision={cfg.train.precision} needs a GPU; use train.precision=no on CPU")
    acc = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=cfg.train.precision)
    rank, world = acc.process_index, acc.num_processes
    run_dir = cfg.resolved_run_dir
    if (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir()):
        raise ConfigError(f"{run_dir} already holds checkpoints; choose another run_dir (or name) or remove it")
    try:
        urls, total = resolve_shards(cfg.data.train)
        check_shard_count(len(urls), world, cfg.data.num_workers)
        model_cfg = factory.resolve_model_cfg(cfg.model.arch, cfg.model.text_model, cfg.model.overrides)
        if cfg.model.text_from_targets:
            factory.check_text_from_targets(model_cfg, cfg.targets.model)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(str(e)) from None
    if total is None and cfg.data.num_samples is None:
        raise ConfigError("data.train is a url list without sizes.json: set data.num_samples")
    sched = resolve_schedule(cfg, total or 0, world)
    try:
        objective = build_objective([t.model_dump() for t in cfg.loss], rank=rank, world_size=world,
                                    dataset_size=sched["num_samples"])
    except ValueError as e:
        raise ConfigError(str(e)) from None
    needs_targets = cfg.model.text_from_targets or any(t.name in NEEDS_TARGETS for t in cfg.loss)
    plan = target_plan(cfg, urls, needs_targets)

    set_seed(cfg.seed)
    model_cfg = factory.with_logit_init(model_cfg, objective.init_logit_scale, objective.init_logit_bias)
    model = factory.build_dual_encoder(
        model_cfg, pretrained=cfg.model.pretrained, arch=cfg.model.arch, lock_text=cfg.model.lock_text,
        text_from_targets=cfg.model.text_from_targets,
    )
    preprocess_cfg = factory.default_preprocess_cfg(model_cfg)
    from open_clip.transform import PreprocessCfg, image_transform_v2

    decoder = SampleDecoder(
        image_transform_v2(PreprocessCfg(**preprocess_cfg), is_train=True),
        tokenizer=None if cfg.model.text_from_targets else factory.make_tokenizer(model_cfg),
        embeddings={"shards": "require", "online": "ignore", "none": "ignore"}[plan],
    )
    stream = ShardStream(urls, decoder, batch_size=cfg.data.batch_size, seed=cfg.seed,
                         shuffle_buffer=cfg.data.shuffle_buffer, rank=rank, world_size=world)
    loader = make_loader(stream, cfg.data.num_workers, pin_memory=acc.device.type == "cuda")
    opt = torch.optim.AdamW(param_groups(model, cfg.optim.weight_decay), lr=cfg.optim.lr,
                            betas=cfg.optim.betas, eps=cfg.optim.eps)
    model, opt = acc.prepare(model, opt)
    target_encoder = load_target_encoder(cfg.targets.model, str(acc.device)) if plan == "online" else None

    if acc.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(cfg, dict(sched, targets=plan)))
        (run_dir / "model_config.json").write_text(
            json.dumps({"model_cfg": model_cfg, "preprocess_cfg": preprocess_cfg}, indent=2))
        (run_dir / "provenance.json").write_text(json.dumps(provenance({"world_size": world}), indent=2))
        (run_dir / "log.jsonl").unlink(missing_ok=True)
    acc.wait_for_everyone()
    return Run(cfg, acc, model, objective, opt, loader, sched, run_dir, target_encoder,
               JsonlLog(run_dir / "log.jsonl") if acc.is_main_process else None)


def train_step(run: Run, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
    """One optimizer step on one batch; returns the objective's named terms and the total."""
    from mmpretrain.schedule import lr_at

    cfg, acc = run.cfg, run.accelerator
    lr = lr_at(run.step, base_lr=cfg.optim.lr, warmup_steps=run.schedule["warmup_steps"],
               total_steps=run.schedule["total_steps"], min_lr_ratio=cfg.optim.min_lr_ratio)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    images = batch["images"].to(acc.device, non_blocking=True)
    targets = batch.get("target_embeddings")
    if run.target_encoder is not None:
        with torch.no_grad():
            targets = run.target_encoder.encode(batch["texts"], convert_to_tensor=True, normalize_embeddings=True)
    if targets is not None:
        targets = targets.to(acc.device, non_blocking=True).float()
    tokens = batch["tokens"].to(acc.device, non_blocking=True) if "tokens" in batch else None
    with acc.autocast():
        feats = run.model(images, tokens=tokens, target_embeddings=targets)
        out = run.objective(**feats, target_embeddings=targets)
    total = sum(v for k, v in out.items() if k.endswith("_loss"))
    if not torch.isfinite(total.detach()):
        raise FloatingPointError(f"non-finite loss at step {run.step}: " +
                                 ", ".join(f"{k}={float(v):.4g}" for k, v in out.items() if k.endswith('_loss')))
    acc.backward(total)
    if cfg.optim.grad_clip_norm is not None:
        acc.clip_grad_norm_(run.model.parameters(), cfg.optim.grad_clip_norm)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        acc.unwrap_model(run.model).clip.logit_scale.clamp_(0, math.log(cfg.train.max_logit_scale))
    out["loss"] = total.detach()
    out["lr"] = torch.tensor(lr)
    return out


def _log_record(run: Run, out: dict[str, torch.Tensor], since: float, steps: int) -> dict[str, Any]:
    acc = run.accelerator
    keys = sorted(k for k in out if k.endswith("_loss") or k.endswith("_unweighted") or k == "loss")
    vals = acc.reduce(torch.stack([out[k].detach().float() for k in keys]).to(acc.device), reduction="mean")
    rec: dict[str, Any] = {"step": run.step, "samples": run.samples,
                           "epoch": run.samples / run.schedule["num_samples"], "lr": float(out["lr"])}
    rec.update({k: float(v) for k, v in zip(keys, vals.tolist())})
    rec["logit_scale"] = float(acc.unwrap_model(run.model).clip.logit_scale.detach().exp())
    rec["samples_per_s"] = steps * run.schedule["global_batch_size"] / max(time.time() - since, 1e-9)
    rec["skipped"] = dict(run.skipped)
    return rec


def fit(run: Run) -> dict[str, Any]:
    from tqdm import tqdm

    from mmpretrain.checkpoint import save_checkpoint
    from mmpretrain.run_files import plot_losses

    cfg, acc, total_steps = run.cfg, run.accelerator, run.schedule["total_steps"]
    run.model.train()
    bar = tqdm(total=total_steps, disable=not (acc.is_main_process and cfg.train.progress), desc="train")
    it = iter(run.loader)
    t0, last = time.time(), time.time()
    rec: dict[str, Any] = {}
    while run.step < total_steps:
        batch = next(it)
        run.skipped.update(batch["skipped"])
        out = train_step(run, batch)
        run.step += 1
        run.samples += run.schedule["global_batch_size"]
        bar.update(1)
        if run.step % cfg.train.log_every == 0 or run.step == total_steps:
            rec = _log_record(run, out, last, cfg.train.log_every if run.step % cfg.train.log_every == 0
                              else run.step % cfg.train.log_every)
            last = time.time()
            bar.set_postfix(loss=f"{rec['loss']:.3f}", scale=f"{rec['logit_scale']:.1f}")
            if run.log is not None:
                run.log.write(rec)
        if cfg.train.save_every and run.step % cfg.train.save_every == 0 and run.step < total_steps:
            save_checkpoint(acc, run.run_dir, run.step, _train_state(run))
    bar.close()
    ckpt = save_checkpoint(acc, run.run_dir, run.step, _train_state(run))
    if run.log is not None:
        plot_losses(run.log.records, run.run_dir / "plots")
    summary = {"steps": run.step, "samples": run.samples, "seconds": round(time.time() - t0, 1),
               "final": rec, "checkpoint": str(ckpt)}
    if acc.is_main_process:
        print(json.dumps(summary))
    return summary


def _train_state(run: Run) -> dict[str, Any]:
    return {"samples": run.samples, "epoch": run.samples / run.schedule["num_samples"],
            "schedule": run.schedule, "skipped": dict(run.skipped)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mmpretrain.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML experiment config (see configs/)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100 data.batch_size=64")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        run = setup(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    fit(run)
    run.accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
