"""The run's training inputs, made in :func:`mmpretrain.train.run_setup.setup`: the sources with everything
attached to them (sidecar embeddings, keep-lists, stored teachers), the stream plan and schedule over
them, the image input (open_clip's training transform in the loader, its normalisation and optionally
decoding on the device) and the rank's loader. ``model`` arguments are :class:`~mmpretrain.train.run_setup.Model`
records (their ``model_cfg`` and ``preprocess_cfg`` are read)."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from open_clip.transform import PreprocessCfg, image_transform_v2

from mmpretrain.config import ConfigError, ExperimentConfig
from mmpretrain.data import host_memory
from mmpretrain.data.crop import ResizedCrop
from mmpretrain.data.decode import DeviceNormalize, KeepImage, SampleDecoder, split_normalize
from mmpretrain.data.device_decode import DeviceDecoder
from mmpretrain.data.image_input import ImageInput
from mmpretrain.data.keep import attach_keep
from mmpretrain.data.loader import make_loader
from mmpretrain.data.plan import StreamPlan
from mmpretrain.data.position import StreamPosition
from mmpretrain.data.sidecar import attach_embeddings
from mmpretrain.data.sources import Source, resolve_sources
from mmpretrain.data.stream import TrainStream
from mmpretrain.data.teacher import attach_teachers
from mmpretrain.losses import WeightedObjective
from mmpretrain.models import factory
from mmpretrain.models.naflex import for_eval, is_naflex, naflex_geometry
from mmpretrain.train.schedule import Schedule, resolve_schedule


@dataclass
class Data:
    """The training data as planned: sources, the stream plan and the schedule it implies."""

    sources: list[Source]
    plan: StreamPlan
    schedule: Schedule


def load_sources(cfg: ExperimentConfig) -> list[Source]:
    """``data.train``'s sources with their sidecar embeddings and keep-lists (the kept counts replace the
    shards'; sample indices stay theirs)."""
    try:  # data.remote: carried by each source to every read of its files (the loader workers' too)
        sources = resolve_sources(cfg.data.train, cfg.data.weights, cfg.data.remote)
        attach_embeddings(sources, cfg.data.embeddings)
        attach_keep(sources, cfg.data.keep)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(str(e)) from None
    return sources


def attach_teachers_for(cfg: ExperimentConfig, sources: list[Source], objective: WeightedObjective) -> list[int] | None:
    """The stored teachers' widths when the objective distills from them (attached to the sources, before
    the plan is made from them), else None."""
    if "teacher" not in objective.needs:
        return None
    try:
        return attach_teachers(sources, cfg.data.embeddings)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def build_data(cfg: ExperimentConfig, sources: list[Source], world_size: int) -> Data:
    """The stream plan over ``sources`` (everything attached to them) and the schedule it implies."""
    try:
        nf = cfg.data.naflex
        plan = StreamPlan(sources, cfg.data.mode, cfg.seed, world_size, max(1, cfg.data.num_workers),
                          cfg.data.batch_size, samples_per_epoch(cfg, sources), cfg.data.shuffle_buffer,
                          naflex=(tuple(nf.seq_lens), nf.max_tokens_per_batch) if nf is not None else None)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return Data(sources, plan, resolve_schedule(cfg, plan.steps_per_epoch, plan.num_samples, world_size,
                                                plan.batch_size))


def samples_per_epoch(cfg: ExperimentConfig, sources: list[Source]) -> int:
    """The dataset's samples (epoch mode; kept ones with data.keep) or ``data.num_samples``."""
    return cfg.data.num_samples or sum(s.num_samples for s in sources)


def shard_sharing_note(plan: StreamPlan) -> str | None:
    """A note when readers outnumber shards in epoch mode: ranges then start inside shards, and a
    remote shard is streamed from its start by each reader whose range it holds."""
    if plan.mode != "epoch" or plan.readers <= len(plan.urls):
        return None
    return (f"{plan.readers} readers ({plan.world_size} rank(s) x {plan.workers} worker(s)) share {len(plan.urls)} "
            f"shard(s): each reads its own range of them (remote shards are streamed up to the range; write smaller "
            "shards with data_tools build --shard-size to read less)")


def train_transform(cfg: ExperimentConfig, model):
    """``(loader transform, DeviceNormalize)``: open_clip's training transform for the model's
    preprocessing and ``data.aug_cfg``, its augmentation in the loader (the fast crop path when it is the
    plain random resized crop), its normalisation on the device."""
    import warnings

    from open_clip.transform import AugmentationCfg

    aug = {k: v for k, v in cfg.data.aug_cfg.items() if v is not None}
    if not aug.get("use_timm"):  # what open_clip's own transform reads; it would warn and ignore the rest
        unused = sorted({"ratio", "re_prob", "re_count"} & set(aug))
        if "color_jitter" in aug and not aug.get("color_jitter_prob"):
            unused.append("color_jitter")
        if unused:
            raise ConfigError(f"data.aug_cfg: open_clip ignores {unused} without use_timm: true "
                              "(color_jitter needs color_jitter_prob); set use_timm or remove them")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Unused augmentation cfg items")  # its list includes what it used
        try:
            full = image_transform_v2(PreprocessCfg(**model.preprocess_cfg), is_train=True,
                                      aug_cfg=AugmentationCfg(**cfg.data.aug_cfg))
        except ImportError as e:
            raise ConfigError(f"data.aug_cfg.use_timm needs timm: pip install timm ({e})") from None
        except (AssertionError, TypeError, ValueError) as e:
            why = str(e) or "color_jitter_prob needs color_jitter as four numbers"
            raise ConfigError(f"open_clip rejects data.aug_cfg={cfg.data.aug_cfg}: {why}") from None
    return split_normalize(full, fast=True)


def image_input(cfg: ExperimentConfig, model, device: torch.device, dtype: torch.dtype | None = None,
                teacher: bool = False) -> ImageInput:
    """The run's :class:`~mmpretrain.data.image_input.ImageInput`: open_clip's training transform in the
    loader, its normalisation on the device and, with ``data.decode=device`` (read here only), the
    device decoder. ``teacher``: the objective trains on stored teacher crops."""
    if cfg.data.naflex is not None:  # each image to its batch's grid in collate; normalised on the device
        pre = model.preprocess_cfg
        return ImageInput(KeepImage(), DeviceNormalize(pre["mean"], pre["std"]), None, False, dtype)
    transform, normalize = train_transform(cfg, model)
    if teacher and not isinstance(transform, ResizedCrop):
        raise ConfigError(f"the objective trains on the teacher's stored crops, which replay open_clip's plain random "
                          f"resized crop; data.aug_cfg={cfg.data.aug_cfg} adds other augmentations: keep only scale in "
                          "data.aug_cfg (the stored crops set it), or drop distill from loss")
    decoder = None
    if cfg.data.decode == "device":
        if not isinstance(transform, ResizedCrop):
            raise ConfigError(f"data.decode=device decodes and crops with open_clip's plain random resized crop; "
                              f"data.aug_cfg={cfg.data.aug_cfg} runs torchvision's or timm's transform, which "
                              "only the workers run: set data.decode=worker, or keep only scale in data.aug_cfg")
        decoder = DeviceDecoder(transform, device, normalize, channels_last=cfg.train.channels_last)
    return ImageInput(transform, normalize, decoder, cfg.train.channels_last, dtype)


def pins(device: torch.device) -> bool:
    """Whether the loader pins its batches for ``device`` (CUDA: the copies to it then never wait for the
    host; :mod:`mmpretrain.data.transfer`)."""
    return device.type == "cuda"


def build_loader(cfg: ExperimentConfig, data: Data, model, objective: WeightedObjective, target_from: str,
                 position: StreamPosition | None, rank: int, pin_memory: bool, embedding_dim: int | None,
                 images: ImageInput, tokenizer):
    """The rank's loader; ``position``: a restored stream position to continue from (None: the start);
    ``images``: the run's image input (its loader transform, made once in setup); ``tokenizer``: the run's
    (None when the text side is the stored embeddings)."""
    size = model.preprocess_cfg["size"]
    transform = images.transform
    decoder = SampleDecoder(  # no whole-image draft: the fast crop path reduces from the crop box itself
        transform,
        embeddings={"shards": "require", "online": "ignore", "none": "ignore"}[target_from],
        embedding_dim=embedding_dim, max_pixels=cfg.data.max_pixels, captions=cfg.data.captions,
        device_decode=images.device_decode, needs=objective.needs, local_crops=objective.local_crops,
    )
    patch = naflex_patch(model.module.clip.visual) if cfg.data.naflex is not None else 0
    stream = TrainStream(data.plan, decoder, rank, start=position.state() if position is not None else None,
                         tokenizer=tokenizer, patch_size=patch)
    d = cfg.data
    context = 0 if cfg.model.text_from_targets else model.model_cfg.get("text_cfg", {}).get("context_length", factory.CONTEXT_LENGTH)
    batch = host_memory.batch_bytes(data.schedule.batch_size, size, context, embedding_dim or 0)
    if patch:  # the largest step's patches (uint8) and their coordinates and mask
        batch += cfg.data.naflex.max_tokens_per_batch * (3 * patch * patch + 17) - data.schedule.batch_size * 3 * size * size
    ranks = host_memory.local_ranks()
    try:
        host_memory.check_shm(host_memory.shm_bytes(batch, d.num_workers, d.prefetch_factor, ranks), batch,
                              d.num_workers, d.prefetch_factor, ranks)
    except ValueError as e:
        raise ConfigError(f"data: {e}") from None
    if pin_memory and not host_memory.pin(batch):
        pin_memory = False
        if rank == 0:
            print(f"note: batches of {batch / 2**20:.0f} MiB are not pinned (over {host_memory.PIN_MAX >> 20} MiB: "
                  "the pinned allocator would round each up to a power of two)", file=sys.stderr)
    return make_loader(stream, d.num_workers, pin_memory=pin_memory, worker_nice=d.worker_nice,
                       prefetch_factor=d.prefetch_factor)


def naflex_patch(visual) -> int:
    """The NaFlex image tower's patch size."""
    return naflex_geometry(visual)[0]


def check_naflex(cfg: ExperimentConfig, model) -> None:
    """A NaFlex image tower takes patch sequences (``data.naflex``) and nothing else takes them."""
    naflex = is_naflex(model.model_cfg)
    if naflex and cfg.data.naflex is None:
        raise ConfigError(f"model.arch={cfg.model.arch} is a NaFlex image tower, which takes patch sequences: set "
                          "data.naflex.seq_lens and data.naflex.max_tokens_per_batch (configs/tiny/naflex.yaml)")
    if cfg.data.naflex is not None and not naflex:
        raise ConfigError(f"data.naflex makes patch sequences, which model.arch={cfg.model.arch}'s image tower does not "
                          "take: use a NaFlex arch (mmpt-tiny-naflex, or vision_cfg.timm_model_name naflexvit_*) or "
                          "remove data.naflex")


def eval_preprocess(cfg: ExperimentConfig, model):
    """The evaluation's image transform: open_clip's; a NaFlex model's at its longest training length."""
    if cfg.data.naflex is not None:
        return for_eval(model.module.clip, model.preprocess_cfg, max(cfg.data.naflex.seq_lens))[1]
    return image_transform_v2(PreprocessCfg(**model.preprocess_cfg), is_train=False)
