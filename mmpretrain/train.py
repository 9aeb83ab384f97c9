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
    position: Any = None  # data.stream.StreamPosition of this rank
    nonfinite_steps: int = 0
    preprocess: Any = None  # evaluation transform and tokenizer, for cfg.eval
    tokenizer: Any = None
    histograms: Any = None  # similarity histograms of the last diagnostics batch

    def write(self, rec: dict[str, Any]) -> None:
        """A log record: log.jsonl and the trackers (main process)."""
        if self.log is not None and rec:
            from mmpretrain.observe import numeric

            self.log.write(rec)
            self.accelerator.log(numeric(rec), step=rec["step"])


def setup(cfg: ExperimentConfig) -> Run:
    """Everything a run needs; raises ConfigError (exit 2) before any compute when the config cannot run."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from mmpretrain.data.sources import resolve_sources
    from mmpretrain.data.decode import SampleDecoder
    from mmpretrain.data.plan import StreamPlan, check_shard_count
    from mmpretrain.data.stream import StreamPosition, TrainStream, make_loader
    from mmpretrain.losses import STATEFUL, build_objective, needs_targets
    from mmpretrain.models import factory
    from mmpretrain.models.target_encoder import load_target_encoder, target_plan
    from mmpretrain.run_files import JsonlLog, provenance
    from mmpretrain.schedule import param_groups

    if cfg.train.precision != "no" and not torch.cuda.is_available():
        raise ConfigError(f"train.precision={cfg.train.precision} needs a GPU; use train.precision=no on CPU")
    run_dir = cfg.resolved_run_dir
    try:
        acc = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=cfg.train.precision,
                          log_with=list(cfg.train.log_with) or None, project_dir=str(run_dir))
    except (ValueError, ImportError) as e:
        raise ConfigError(f"train.log_with={cfg.train.log_with}: {e} (pip install the tracker, or drop it)") from None
    rank, world = acc.process_index, acc.num_processes
    from mmpretrain.checkpoint import flat_config, resume_point

    ckpt, saved = resume_point(cfg, run_dir)
    try:
        sources = resolve_sources(cfg.data.train, cfg.data.weights)
        urls = [u for src in sources for u in src.urls]
        check_shard_count(len(urls), world, cfg.data.num_workers)
        total = sum(src.num_samples for src in sources)
        plan = StreamPlan(sources, cfg.data.mode, cfg.seed, world, max(1, cfg.data.num_workers), cfg.data.batch_size,
                          cfg.data.num_samples or total, cfg.data.shuffle_buffer)
        model_cfg = factory.resolve_model_cfg(cfg.model.arch, cfg.model.text_model, cfg.model.overrides)
        if cfg.model.text_from_targets:
            factory.check_text_from_targets(model_cfg, cfg.targets.model)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(str(e)) from None
    sched = resolve_schedule(cfg, plan.steps_per_epoch, plan.num_samples, world)
    try:
        objective = build_objective([t.model_dump() for t in cfg.loss], rank=rank, world_size=world,
                                    dataset_size=sched["num_samples"])
    except ValueError as e:
        raise ConfigError(str(e)) from None
    targets = target_plan(cfg, urls, cfg.model.text_from_targets or any(needs_targets(t.model_dump()) for t in cfg.loss))

    set_seed(cfg.seed)
    model_cfg = factory.with_logit_init(model_cfg, objective.init_logit_scale, objective.init_logit_bias)
    try:
        model = factory.build_dual_encoder(
            model_cfg, pretrained=cfg.model.pretrained, arch=cfg.model.arch, lock_text=cfg.model.lock_text,
            text_from_targets=cfg.model.text_from_targets, lock_text_unlocked_layers=cfg.model.lock_text_unlocked_layers,
            lock_image=cfg.model.lock_image, lock_image_unlocked_groups=cfg.model.lock_image_unlocked_groups,
            grad_checkpointing=cfg.model.grad_checkpointing,
        )
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from None
    preprocess_cfg = factory.default_preprocess_cfg(model_cfg)
    from open_clip.transform import PreprocessCfg, image_transform_v2

    decoder = SampleDecoder(
        image_transform_v2(PreprocessCfg(**preprocess_cfg), is_train=True),
        embeddings={"shards": "require", "online": "ignore", "none": "ignore"}[targets],
        draft_size=max(preprocess_cfg["size"]) if isinstance(preprocess_cfg["size"], (list, tuple))
        else preprocess_cfg["size"],
        labels=any(t.name in STATEFUL for t in cfg.loss),  # region purity
    )
    position = StreamPosition(plan)
    if saved is not None:
        if len(saved["loader"]) != world:
            raise ConfigError(f"{ckpt} was written by {len(saved['loader'])} process(es), this run has {world}: an "
                              "exact resume needs the same number (or start anew with model.pretrained=CHECKPOINT)")
        try:
            position.load(saved["loader"][rank])
        except ValueError as e:
            raise ConfigError(str(e)) from None
    stream = TrainStream(plan, decoder, rank, start=position.state() if saved is not None else None,
                         tokenizer=None if cfg.model.text_from_targets else factory.make_tokenizer(model_cfg))
    loader = make_loader(stream, cfg.data.num_workers, pin_memory=acc.device.type == "cuda",
                         worker_nice=cfg.data.worker_nice)
    impl = cfg.optim.implementation
    opt = torch.optim.AdamW(param_groups(model, cfg.optim.weight_decay), lr=cfg.optim.lr, betas=cfg.optim.betas,
                            eps=cfg.optim.eps, fused=impl == "fused" or None, foreach=impl == "foreach")
    model, opt = acc.prepare(model, opt)
    objective.to(acc.device)
    target_encoder = load_target_encoder(cfg.targets.model, str(acc.device)) if targets == "online" else None

    records: list[dict[str, Any]] = []
    if saved is not None:
        acc.load_state(str(ckpt))  # model (safetensors), optimizer and RNG states (torch.load weights_only)
        if objective.state_dict():  # region weighting: bank, centroids, weights
            from mmpretrain.checkpoint import load_objective_state

            load_objective_state(objective, ckpt)
        log_path = run_dir / "log.jsonl"
        if log_path.is_file():  # records after the checkpoint belong to the interrupted attempt
            records = [r for r in map(json.loads, log_path.read_text().splitlines()) if r["step"] <= saved["step"]]
    acc.wait_for_everyone()
    if acc.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(cfg, dict(sched, targets=targets, readers_per_rank=plan.workers,
                                                              dropped_per_epoch=plan.dropped_per_epoch)))
        (run_dir / "model_config.json").write_text(
            json.dumps({"model_cfg": model_cfg, "preprocess_cfg": preprocess_cfg}, indent=2))
        (run_dir / "provenance.json").write_text(json.dumps(provenance({"world_size": world}), indent=2))
        (run_dir / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    acc.wait_for_everyone()
    run = Run(cfg, acc, model, objective, opt, loader, sched, run_dir, target_encoder,
              JsonlLog(run_dir / "log.jsonl") if acc.is_main_process else None, position=position,
              preprocess=image_transform_v2(PreprocessCfg(**preprocess_cfg), is_train=False),
              tokenizer=factory.make_tokenizer(model_cfg))
    if cfg.train.log_with:
        from mmpretrain.observe import numeric

        hparams = {k: str(v) if isinstance(v, (list, dict)) else v
                   for k, v in flat_config(cfg.model_dump(mode="json")).items() if v is not None}
        acc.init_trackers("mmpretrain", config=hparams | numeric(sched, "resolved/"),
                          init_kwargs={"wandb": {"name": cfg.name, "dir": str(run_dir)}})
    if saved is not None:
        run.step, run.samples = saved["step"], saved["samples"]
        run.nonfinite_steps = saved.get("nonfinite_steps", 0)
        if acc.is_main_process:  # the saved counts are sums over ranks
            run.skipped.update(saved["skipped"])
            run.log.records = records
        print(f"resumed from {ckpt} at step {run.step}", file=sys.stderr) if acc.is_main_process else None
    return run



def train_step(run: Run, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
    """One optimizer step on one batch; returns the objective's named terms and the total."""
    from mmpretrain.grad_cache import forward_backward
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

    ok = []

    def finite(out: dict[str, torch.Tensor], total: torch.Tensor) -> bool:
        bad = (~torch.isfinite(total.detach())).float().reshape(1)
        if acc.num_processes > 1:  # every rank takes the same decision
            bad = acc.reduce(bad.to(acc.device), reduction="sum")
        ok.append(not bad.item())
        return ok[-1]

    labels = batch.get("labels")
    kw = {"step": run.step, "epoch": run.samples // run.schedule["num_samples"] + 1,
          "labels": None if labels is None else labels.to(acc.device, non_blocking=True)}
    out = forward_backward(acc, run.model, run.objective, images, tokens, targets, check=finite,
                           micro_batch=cfg.train.micro_batch_size, mode=cfg.train.micro_batch_mode, objective_kwargs=kw)
    out["lr"] = torch.tensor(lr)
    if not ok[-1]:
        terms = ", ".join(f"{k}={float(v):.4g}" for k, v in out.items() if k.endswith(("_loss", "_unweighted")))
        run.nonfinite_steps += 1
        if cfg.train.nonfinite == "stop" or run.nonfinite_steps > cfg.train.max_skipped_steps:
            raise FloatingPointError(f"non-finite loss at step {run.step} ({terms}); the last checkpoint holds the "
                                     "state before it (train.nonfinite=skip skips such steps)")
        print(f"warning: non-finite loss at step {run.step} ({terms}): step skipped "
              f"({run.nonfinite_steps}/{cfg.train.max_skipped_steps})", file=sys.stderr)
        run.optimizer.zero_grad(set_to_none=True)
        return {k: torch.zeros(()) if k.endswith(("_loss", "_unweighted")) or k == "loss" else v
                for k, v in out.items()}
    if cfg.optim.grad_clip_norm is not None:
        acc.clip_grad_norm_(run.model.parameters(), cfg.optim.grad_clip_norm)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        acc.unwrap_model(run.model).clip.logit_scale.clamp_(0, math.log(cfg.train.max_logit_scale))
    return out


def fit(run: Run) -> dict[str, Any]:
    from tqdm import tqdm

    from mmpretrain.checkpoint import save_checkpoint
    from mmpretrain.metrics import plot_run
    from mmpretrain.observe import diagnostics, evaluate, log_record

    cfg, acc, total_steps = run.cfg, run.accelerator, run.schedule["total_steps"]
    run.model.train()
    bar = tqdm(total=total_steps, initial=run.step, disable=not (acc.is_main_process and cfg.train.progress),
               desc="train", unit="step")
    it = iter(run.loader)
    t0, last, last_step = time.time(), time.time(), run.step
    rec: dict[str, Any] = {}
    while run.step < total_steps:
        batch = next(it)
        run.skipped.update(batch["skipped"])
        run.position.advance(batch)
        out = train_step(run, batch)
        run.step += 1
        run.samples += run.schedule["global_batch_size"]
        bar.update(1)
        end = run.step == total_steps
        diag = bool(cfg.train.diagnostics_every) and (run.step % cfg.train.diagnostics_every == 0 or end)
        if run.step % cfg.train.log_every == 0 or end or diag:
            rec = log_record(run, out, last, run.step - last_step)
            if diag:
                rec.update(diagnostics(run, out))
            last, last_step = time.time(), run.step
            bar.set_postfix(loss=f"{rec['loss']:.3f}", scale=f"{rec['logit_scale']:.1f}",
                            samples_s=f"{rec['samples_per_s']:.0f}")
            run.write(rec)
        if cfg.eval is not None and (run.step % cfg.eval.every == 0 or end):
            run.write(evaluate(run))
        if cfg.train.save_every and run.step % cfg.train.save_every == 0 and not end:
            _push(run, save_checkpoint(acc, run.run_dir, run.step, _train_state(run), cfg.train.keep_last,
                                       _objective_state(run)))
    bar.close()
    ckpt = save_checkpoint(acc, run.run_dir, run.step, _train_state(run), cfg.train.keep_last, _objective_state(run))
    _push(run, ckpt)
    if run.log is not None:
        plot_run(run.log.records, run.histograms, run.run_dir / "plots")
    summary = {"steps": run.step, "samples": run.samples, "seconds": round(time.time() - t0, 1),
               "final": rec, "checkpoint": str(ckpt)}
    if acc.is_main_process:
        print(json.dumps(summary))
    return summary


def _push(run: Run, ckpt: Path) -> None:
    """``hub.push_every``: upload the checkpoint (main process; the token is huggingface_hub's business)."""
    hub = run.cfg.hub
    if hub is None or not hub.push_every or run.step % hub.push_every or not run.accelerator.is_main_process:
        return
    from huggingface_hub import create_repo, upload_folder

    create_repo(hub.repo_id, private=hub.private, exist_ok=True)
    upload_folder(repo_id=hub.repo_id, folder_path=str(ckpt), path_in_repo=f"checkpoints/{ckpt.name}",
                  revision=hub.revision, commit_message=f"checkpoint at step {run.step}")


def _objective_state(run: Run) -> dict[str, torch.Tensor] | None:
    """A stateful objective's tensors (region weighting's bank, centroids, weights), else None."""
    state = getattr(run.objective, "state_dict", None)
    return state() if state is not None else None


def _train_state(run: Run) -> dict[str, Any]:
    """JSON: counters, and every rank's data-stream position (``loader[rank]``) for an exact resume."""
    from accelerate.utils import gather_object

    from mmpretrain.observe import all_ranks_skipped

    positions = [run.position.state()]
    if run.accelerator.num_processes > 1:
        positions = gather_object(positions)
    return {"samples": run.samples, "epoch": run.samples / run.schedule["num_samples"],
            "schedule": run.schedule, "skipped": all_ranks_skipped(run), "loader": positions,
            "nonfinite_steps": run.nonfinite_steps, "config": run.cfg.model_dump(mode="json")}


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
    try:
        fit(run)
    except FloatingPointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    run.accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
