"""``setup(cfg) -> Run``: the data, the objective, the model and optimizer, then the saved state when
resuming. Every mistake a user can fix raises :class:`~mmpretrain.config.ConfigError` (exit 2) before
any compute."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from typing import Any

import torch
from accelerate.utils import set_seed

from mmpretrain.config import ConfigError, ExperimentConfig, flat_config, to_yaml
from mmpretrain.data.manifest import provenance_record
from mmpretrain.data.sidecar import check_extra_rows, recorded, stored_dim
from mmpretrain.data.sources import Source
from mmpretrain.eval import Evaluator, expand_jobs, load_task_data
from mmpretrain.hub_cache import offline, require_model
from mmpretrain.losses import WeightedObjective, build_objective
from mmpretrain.models import factory
from mmpretrain.models.caption import decoder_shape, is_coca
from mmpretrain.models.lora import apply_lora_note
from mmpretrain.models.patch_dropout import PatchDraw
from mmpretrain.models.target_encoder import choose_target_source, load_target_encoder
from mmpretrain.models.text import trims_text
from mmpretrain.run_files import JsonlLog, RunFolder, provenance
from mmpretrain.train.checkpoint import build_position, check_layout, decide_resume, restore_state
from mmpretrain.train.disk import CheckpointWriteError, check_disk
from mmpretrain.train.ema import make_ema
from mmpretrain.train.engine import (
    configure_engine,
    engine_name,
    input_dtype,
    make_accelerator,
    sharded_engine,
)
from mmpretrain.train.inputs import (
    Data,
    attach_teachers_for,
    build_data,
    build_loader,
    check_naflex,
    eval_preprocess,
    image_input,
    load_sources,
    pins,
    samples_per_epoch,
    shard_sharing_note,
)
from mmpretrain.train.layer_decay import layer_decay_note
from mmpretrain.train.phases import PositionResize, check_phases, phase_at, phase_config, resolve_phases
from mmpretrain.train.schedule import param_groups
from mmpretrain.train.ssl_setup import attach_self_supervised
from mmpretrain.train.state import Run, TrainState, numeric
from mmpretrain.train.task import TrainingTask


@dataclass
class Model:
    """The model to train and the two halves of its open_clip config (written as ``model_config.json``)."""

    module: factory.DualEncoder
    model_cfg: dict
    preprocess_cfg: dict


def build_objective_for(cfg: ExperimentConfig, rank: int, world_size: int, dataset_size: int,
                        index_size: int | None = None, sharded: str | None = None) -> WeightedObjective:
    """The configured objective; ``sharded``: the engine (FSDP, DeepSpeed) when the weights are sharded."""
    try:
        objective = build_objective([t.model_dump() for t in cfg.loss], rank=rank, world_size=world_size,
                                    dataset_size=dataset_size, index_size=index_size)
        encodings_from = objective.encodings
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if encodings_from == "ema" and cfg.train.ema is None:
        raise ConfigError("loss resa: options.encodings=ema takes the targets from the weight average's image tower "
                          "(ReSA's momentum encoder): set train.ema (e.g. {decay: 0.99}), or encodings=online")
    if encodings_from is not None and sharded is not None:
        raise ConfigError("loss resa reads the image tower's output before its projection, which is not offered "
                          "under FSDP or DeepSpeed here (the tower's weights are sharded): train it with data "
                          "parallelism (configs/accelerate/8gpu.yaml)")
    return objective


def target_source(cfg: ExperimentConfig, sources: list[Source], objective: WeightedObjective) -> str:
    """``shards``, ``online`` or ``none``: where the caption embeddings the objective (or the
    text-from-targets model) needs come from."""
    models = {recorded(s).get("model") for s in sources}
    try:
        return choose_target_source(cfg.targets.source, cfg.targets.model, models,
                                    needed=cfg.model.text_from_targets or "targets" in objective.needs,
                                    text_from_targets=cfg.model.text_from_targets)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def embedding_dim(cfg: ExperimentConfig, sources: list[Source], target_from: str, model: Model) -> int | None:
    """The stored caption embeddings' dimension (targets from the shards), checked before training
    (:func:`mmpretrain.data.sidecar.stored_dim`) and, with ``text_from_targets``, against the text
    tower's input."""
    if target_from != "shards":
        return None
    try:
        dim = stored_dim(sources, cfg.targets.model)
        if cfg.data.captions == "sample":
            check_extra_rows(sources, cfg.targets.model)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    text = getattr(model.module.clip, "text", None)
    want = getattr(getattr(text, "proj", None), "in_features", None)
    if cfg.model.text_from_targets and want is not None and want != dim:
        raise ConfigError(f"model.text_from_targets: the stored embeddings have dimension {dim}, the text tower "
                          f"takes {want}: embed with the tower's model ({cfg.targets.model}?) or set "
                          "model.text_from_targets=false")
    return dim


def build_model(cfg: ExperimentConfig, objective: WeightedObjective, sharded: str | None = None) -> Model:
    """The dual encoder, with the objective's preferred initial logit scale and bias (seeded); ``sharded``:
    the engine (FSDP, DeepSpeed) when the weights are sharded."""
    m = cfg.model
    try:
        model_cfg = factory.resolve_model_cfg(m.arch, m.text_model, m.overrides)
        if factory.is_hf_text(model_cfg):
            require_model(model_cfg["text_cfg"]["hf_model_name"],
                          "model.text_model" if m.text_model else f"model.arch={m.arch}'s text tower")
        if m.text_from_targets:
            factory.check_text_from_targets(model_cfg, cfg.targets.model)
            if "negatives" in objective.needs:
                raise ValueError("hard_negatives needs the text tower to encode the negative captions; with "
                                 "model.text_from_targets=true the text side is the stored embeddings: set it false")
        model_cfg = factory.with_logit_init(model_cfg, objective.init_logit_scale, objective.init_logit_bias)
        set_seed(cfg.seed)
        module = factory.build_dual_encoder(
            model_cfg, pretrained=m.pretrained, arch=m.arch, lock_text=m.lock_text, text_from_targets=m.text_from_targets,
            lock_text_unlocked_layers=m.lock_text_unlocked_layers, lock_image=m.lock_image,
            lock_image_unlocked_groups=m.lock_image_unlocked_groups, grad_checkpointing=m.grad_checkpointing,
            nonscalar_logit_scale=sharded is not None, max_logit_scale=cfg.train.max_logit_scale,
            patch_dropout_prob=m.patch_dropout,
        )
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from None
    except (TypeError, RuntimeError) as e:  # what check_overrides cannot foresee, e.g. a negative width
        raise ConfigError(f"open_clip cannot build model.arch={m.arch} with model.overrides={m.overrides}: {e}") from None
    # a scale or bias no term uses would get no gradient: DDP stops at the second step on it
    if not objective.uses_logit_scale:
        module.clip.logit_scale.requires_grad_(False)
    if module.clip.logit_bias is not None and not objective.uses_logit_bias:
        module.clip.logit_bias.requires_grad_(False)
    if m.lora is not None:
        apply_lora_note(module, m, sharded)
    check_caption(cfg, objective, model_cfg, module)
    attach_self_supervised(cfg, objective, module, sharded)
    if "image_encodings" in objective.needs and not factory.has_pre_projection(module.clip.visual):
        raise ConfigError(f"loss resa needs the image tower's output before its projection, which model.arch={m.arch}'s "
                          f"{type(module.clip.visual).__name__} does not expose (open_clip's ViT towers do)")
    return Model(module, model_cfg, factory.default_preprocess_cfg(model_cfg))


def check_caption(cfg: ExperimentConfig, objective: WeightedObjective, model_cfg: dict, module) -> None:
    """The caption objective takes a CoCa arch's decoder and the batch's caption tokens, beside a contrastive
    term, without grad caching; its matrix is the decoder's logits. A CoCa arch trained without it keeps its
    decoder frozen (no gradient: DDP stops at the second step on a parameter that gets none)."""
    if "caption" not in objective.needs:
        if is_coca(model_cfg):
            module.clip.text_decoder.requires_grad_(False)
        return
    m, t = cfg.model, cfg.train
    if not is_coca(model_cfg):
        raise ConfigError(f"loss caption needs a caption decoder, which model.arch={m.arch} has not: use a CoCa arch "
                          "(mmpt-tiny-coca, coca_ViT-B-32: a multimodal_cfg)")
    if m.text_from_targets:
        raise ConfigError("loss caption decodes the caption's tokens: set model.text_from_targets=false")
    if set(objective.names) <= {"caption"}:
        raise ConfigError("loss caption trains beside a contrastive term, as CoCa does: add {name: clip} (or "
                          "sigmoid) to loss")
    if others := sorted(objective.needs & {"negatives", "image_encodings"}):  # the caption forward returns neither
        raise ConfigError(f"loss caption beside a term that needs {others} (hard_negatives, resa): not offered with "
                          "the caption decoder yet; train them without caption")
    if t.micro_batch_size is not None and t.micro_batch_mode == "grad_cache":
        raise ConfigError("loss caption with train.micro_batch_mode=grad_cache: its loss is per sample, with no "
                          "batch term to cache; use train.micro_batch_mode=accumulate")
    objective.for_decoder(*decoder_shape(model_cfg))


def make_optimizer(cfg: ExperimentConfig, module: torch.nn.Module) -> torch.optim.Optimizer:
    o = cfg.optim
    return torch.optim.AdamW(param_groups(module, o.weight_decay, o.layer_decay), lr=o.lr, betas=o.betas, eps=o.eps,
                             fused=o.implementation == "fused" or None, foreach=o.implementation == "foreach")


def write_run_files(files: RunFolder, cfg: ExperimentConfig, data: Data, model: Model, target_from: str,
                    world_size: int, records: list[dict[str, Any]], largest: int, phases: list | None = None) -> None:
    """config.yaml (resolved), model_config.json, provenance.json (with the training data's manifests)
    and log.jsonl (the records kept from before a resume). Main process."""
    files.root.mkdir(parents=True, exist_ok=True)
    resolved = dict(asdict(data.schedule), targets=target_from, readers_per_rank=data.plan.workers,
                    dropped_per_epoch=data.plan.dropped_per_epoch, largest_matrix=largest)
    if cfg.train.phases:  # train.phases: each phase's steps and settings, and model_config.json the current one's
        resolved["phases"] = [p.record() for p in phases]
    files.config.write_text(to_yaml(cfg, resolved))
    files.write_model_config(model.model_cfg, model.preprocess_cfg)
    sources = [provenance_record(s.spec, s.manifest, s.num_samples, s.keep_record) for s in data.sources]
    files.provenance.write_text(json.dumps(provenance({"world_size": world_size, "data": sources}), indent=2))
    files.log.write_text("".join(json.dumps(r) + "\n" for r in records))


def check_outside_inputs(cfg: ExperimentConfig) -> None:
    """What the config names outside itself, before any work: the run folder can be a folder, the Hub
    is reachable when checkpoints are to be uploaded."""
    root = cfg.resolved_run_dir
    for p in (root, *root.parents):
        if p.exists() and not p.is_dir():
            raise ConfigError(f"run_dir={root}: {p} is a file, not a folder: choose another run_dir (or name)")
    if cfg.hub is not None and offline():
        raise ConfigError(f"hub.repo_id={cfg.hub.repo_id}: the Hub is offline (HF_HUB_OFFLINE=1), so no checkpoint "
                          "could be uploaded: unset HF_HUB_OFFLINE, or remove the hub section and upload later "
                          "with `python -m mmpretrain.export RUN --out DIR --push-to-hub ORG/NAME`")


def load_eval_data(cfg: ExperimentConfig) -> list[tuple[Any, str]]:
    """Each ``eval.datasets`` entry loaded up front (not after the first ``eval.every`` steps)."""
    jobs = []
    for i, (given, task) in enumerate(cfg.eval.jobs):
        try:
            for spec, _ in expand_jobs([(given, task)]):  # sugar_crepe:DIR -> one dataset per split
                jobs.append((load_task_data(spec, task), task))
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(f"eval.datasets.{i}={given} (task {task}): {e}") from None
    return jobs


def setup(cfg: ExperimentConfig) -> Run:
    """Everything a run needs, resuming the run folder's latest checkpoint (or ``resume``) when there is one."""
    check_outside_inputs(cfg)
    eval_jobs = load_eval_data(cfg) if cfg.eval is not None else []
    acc = make_accelerator(cfg)
    rank, world, sharded = acc.process_index, acc.num_processes, sharded_engine(acc)
    files = RunFolder(cfg.resolved_run_dir)
    ckpt, saved = decide_resume(acc, cfg, files)
    if ckpt is not None:
        check_layout(ckpt, engine_name(acc))
    sources = load_sources(cfg)
    # sample indices run over every source's shards (sizes.json): the per-sample tables' length
    objective = build_objective_for(cfg, rank, world, samples_per_epoch(cfg, sources), sharded=sharded,
                                    index_size=sum(sum(s.shard_counts) for s in sources))
    teacher_dims = attach_teachers_for(cfg, sources, objective)
    data = build_data(cfg, sources, world)  # the plan's shard records carry everything attached
    try:
        objective.for_schedule(data.schedule.total_steps)  # start_at as a share of the run's steps
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if acc.is_main_process and (note := shard_sharing_note(data.plan)):
        print(f"note: {note}", file=sys.stderr)
    target_from = target_source(cfg, data.sources, objective)  # shards / online / none
    if target_from == "online":
        try:
            require_model(cfg.targets.model, "targets.model")
        except ValueError as e:
            raise ConfigError(str(e)) from None
    phases = resolve_phases(cfg, data.schedule.total_steps)
    phase = phase_at(phases, saved["step"] if saved is not None else 0)
    model = build_model(phase_config(cfg, phase), objective, sharded)  # at the phase's image size and dropout
    check_phases(phases, model.module.clip.visual, cfg.model.arch, sharded)
    check_naflex(cfg, model)
    # the same initial weights on every rank (seeded above), then each rank its own random stream, so
    # that dropout and patch dropout draw different masks on different ranks (seed + rank)
    set_seed(cfg.seed, device_specific=True)
    state = TrainState(build_position(data.plan, saved, rank, world, ckpt))
    # the augmentation ends in uint8 in the loader; normalisation (and data.decode=device) on the device
    images = image_input(cfg, model, acc.device, input_dtype(acc), teacher=teacher_dims is not None)
    tokenizer = factory.make_tokenizer(model.model_cfg)  # made once: the loader's and the run's
    loader = build_loader(cfg, data, model, objective, target_from, state.position if saved is not None else None, rank,
                          pins(acc.device), embedding_dim(cfg, data.sources, target_from, model), images,
                          None if cfg.model.text_from_targets else tokenizer)
    configure_engine(cfg, acc, data.schedule)
    try:  # every rank: under FSDP and DeepSpeed each writes its shard of every checkpoint
        disk_note = check_disk(files, model.module, cfg.train.keep_last, engine_name(acc))
    except CheckpointWriteError as e:
        raise ConfigError(str(e)) from None
    if disk_note and acc.is_main_process:
        print(f"note: {disk_note}", file=sys.stderr)
    if cfg.train.channels_last:
        model.module.to(memory_format=torch.channels_last)
    if cfg.optim.layer_decay is not None and acc.is_main_process:
        print(layer_decay_note(model.module, cfg.optim), file=sys.stderr)
    module, optimizer = acc.prepare(model.module, make_optimizer(cfg, model.module))
    objective.to(acc.device)
    # a checkpoint of another phase's image size: its position embeddings resized as they load (train/phases.py)
    resize = PositionResize(model.module.clip.visual) if any(p.image_size for p in phases) and saved is not None else None
    ema = make_ema(cfg, acc, module, ckpt if saved is not None else None)
    target_encoder = load_target_encoder(cfg.targets.model, str(acc.device)) if target_from == "online" else None
    records = restore_state(acc, objective, state, files, ckpt, saved) if saved is not None else []
    if resize is not None:
        resize.optimizer(optimizer)
        resize.close()
    acc.wait_for_everyone()
    if acc.is_main_process:
        largest = objective.largest_matrix(data.schedule.batch_size)
        label = " + ".join(getattr(objective, "names", None) or [getattr(objective, "name", "the objective")])
        print(f"note: {label} builds at most {largest:,} elements per matrix on a rank "
              f"({largest * 4 / 2**20:,.1f} MiB in fp32) at {data.schedule.batch_size} x {world} samples", file=sys.stderr)
        write_run_files(files, cfg, data, model, target_from, world, records, largest, phases)
        if starts := [f"{t.name} at step {t.start_step}" for t in objective.terms if hasattr(t, "start_step")]:
            print(f"note: {', '.join(starts)} of {data.schedule.total_steps} (start_at)", file=sys.stderr)
        if cfg.train.phases:
            done = f" ({', '.join(resize.done)}, as {ckpt.name} loaded)" if resize is not None and resize.done else ""
            print(f"note: {phase.describe()}{done}", file=sys.stderr)
    acc.wait_for_everyone()
    evaluator = None
    if cfg.eval is not None:
        evaluator = Evaluator(eval_jobs, batch_size=cfg.eval.batch_size, device=str(acc.device),
                              num_workers=cfg.eval.num_workers, rank=rank, world_size=world)
    run = Run(cfg, acc, module, objective, optimizer, loader, data.schedule, files, state,
              preprocess=eval_preprocess(cfg, model),
              tokenizer=tokenizer, evaluator=evaluator,
              log=JsonlLog(files.log, records) if acc.is_main_process else None, images=images, ema=ema,
              task=TrainingTask(objective, images, target_encoder, trims_text(model.module.clip),
                                cfg.train.text_length_multiple, teacher_dims, ema,
                                patch_dropout=PatchDraw.of(model.module.clip.visual, phase.patch_dropout, cfg.seed),
                                seed=cfg.seed),
              phase=phase)
    if cfg.train.log_with:
        hparams = {k: str(v) if isinstance(v, (list, dict)) else v
                   for k, v in flat_config(cfg.model_dump(mode="json")).items() if v is not None}
        acc.init_trackers("mmpretrain", config=hparams | numeric(asdict(data.schedule), "resolved/"),
                          init_kwargs={"wandb": {"name": cfg.name, "dir": str(files.root)}})
    if saved is not None and acc.is_main_process:
        print(f"resumed from {ckpt} at step {state.step}", file=sys.stderr)
    return run
