"""The config's sections: typed pydantic models that reject unknown keys, with the cross-field checks,
each with a message that says the fix. :mod:`mmpretrain.config.load` builds one from defaults, a YAML
file and dotted overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from mmpretrain.config import outside
from mmpretrain.config.base import DEMO_TEXT_MODEL, ConfigError, RemoteConfig, _Strict

__all__ = ["ConfigError", "DataConfig", "EMAConfig", "EvalConfig", "ExperimentConfig", "HubConfig", "LossTerm",
           "ModelConfig", "OptimConfig", "PhaseConfig", "RemoteConfig", "TargetsConfig", "TrainConfig"]


class NaFlexConfig(_Strict):
    seq_lens: list[int] = Field(min_length=1, description="image sequence lengths (patches) a step is drawn from, "
                                "each length once per cycle of len(seq_lens) steps, seeded; each image keeps its "
                                "aspect ratio at the largest patch grid within the step's length (docs/naflex.md)")
    max_tokens_per_batch: int = Field(gt=0, description="patches per rank per step: a step at length L holds "
                                      "max_tokens_per_batch // L samples on each rank (replaces data.batch_size)")

    @model_validator(mode="after")
    def _lengths(self):
        if any(n <= 0 for n in self.seq_lens) or len(set(self.seq_lens)) != len(self.seq_lens):
            raise ValueError(f"data.naflex.seq_lens must be distinct positive lengths, not {self.seq_lens}")
        if self.max_tokens_per_batch < max(self.seq_lens):
            raise ValueError(f"data.naflex.max_tokens_per_batch={self.max_tokens_per_batch} holds no sample of length "
                             f"{max(self.seq_lens)}: raise it to at least {max(self.seq_lens)} (one sample), or drop "
                             "that length")
        return self


class DataConfig(_Strict):
    train: str = Field(description="dataset folder(s) with sizes.json (as `data_tools build` writes) or shard url "
                       "patterns, several joined by '::' (see mmpretrain/data/sources.py)")
    mode: Literal["epoch", "resampled"] = Field(
        "epoch", description="epoch: every sample once per epoch; resampled: shards drawn with replacement by "
        "data.weights, an epoch is data.num_samples samples")
    embeddings: str | None = Field(None, description="caption embedding folder(s) written by `data_tools embed "
                                   "--out`, one per '::' source of data.train in the same order (default: "
                                   "beside each source's shards, when an embeddings.json is there); the teacher rows of "
                                   "`embed --image-model` (teachers.json) are read from the same folder")
    keep: str | None = Field(None, description="keep-list folder(s) written by `data_tools filter`, one per '::' "
                             "source of data.train (an empty part keeps all of that source): only the listed samples "
                             "are read, an epoch is the kept count, sample indices stay the shards' (docs/data.md)")
    weights: list[float] | None = Field(None, description="resampled mode: one sampling weight per '::' source")
    num_samples: int | None = Field(None, gt=0, description="resampled mode: samples per epoch (default: the "
                                    "dataset's size); epoch mode: leave unset, an epoch is the whole dataset")
    batch_size: int = Field(128, gt=0, description="per-rank batch size")
    num_workers: int = Field(2, ge=0, description="DataLoader workers per rank, each reading its own shard ranges "
                             "(0: in the training process)")
    prefetch_factor: int = Field(2, gt=0, description="batches each worker prepares ahead; host memory per node "
                                 "is about local ranks x (num_workers x prefetch_factor + 2) batches (docs/scale.md)")
    shuffle_buffer: int = Field(1000, ge=0, description="samples per shuffle block of each reader (0 or 1 = none)")
    worker_nice: int = Field(10, ge=0, le=19, description="niceness added to the loader workers, so that on a "
                             "saturated CPU the training threads keep their cores (0: same priority)")
    aug_cfg: dict[str, Any] = Field(default_factory=dict, description="open_clip's training augmentation "
                                    "settings (its --aug-cfg: scale, color_jitter, color_jitter_prob, gray_scale_prob, "
                                    "use_timm, ratio, re_prob, re_count); scale alone keeps the fast crop path, the "
                                    "others run torchvision's / timm's transform")
    captions: Literal["sample", "first"] = Field(
        "sample", description="sample: each epoch trains on one of a sample's captions ({key}.txt and the extra "
        "'captions' of its {key}.json), drawn by (seed, epoch, key), with the drawn caption's embedding row; first: "
        "{key}.txt only")
    decode: Literal["worker", "device"] = Field(
        "worker", description="worker: the loader workers decode, crop and resize every image; device: they draw "
        "the crop box and pass the JPEG's bytes, which the training device decodes in batches (nvJPEG on CUDA), "
        "crops and resizes, for GPUs the workers' cores cannot feed (docs/config.md); needs the plain crop of "
        "data.aug_cfg (scale alone); PNG, WebP and JPEGs nvJPEG cannot take stay with the workers")
    max_pixels: int = Field(64_000_000, gt=0, description="images with more pixels (after JPEG draft scaling) are "
                            "skipped as too_many_pixels before decoding, as data_tools build --max-pixels")
    remote: RemoteConfig = Field(default_factory=RemoteConfig, description="retries, backoff and timeout for "
                                 "remote shards")
    naflex: NaFlexConfig | None = Field(None, description="variable resolution at native aspect ratio for a NaFlex "
                                        "image tower (model.arch mmpt-tiny-naflex, or a timm naflexvit_*): patch "
                                        "sequences and batches by token budget")

    @field_validator("aug_cfg")
    @classmethod
    def _aug_keys(cls, v: dict[str, Any]) -> dict[str, Any]:
        known = outside.augmentation_keys()
        unknown = sorted(set(v) - set(known))
        if unknown:
            raise ValueError(f"unknown data.aug_cfg key(s) {unknown}; open_clip's are {known}")
        for key in ("scale", "ratio"):
            if key in v:
                pair = v[key]
                if (not isinstance(pair, (list, tuple)) or len(pair) != 2
                        or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in pair)
                        or not 0 < pair[0] <= pair[1] or (key == "scale" and pair[1] > 1)):
                    raise ValueError(f"data.aug_cfg.{key} must be two numbers [low, high] with 0 < low <= high"
                                     + (" <= 1" if key == "scale" else "") + f", not {pair!r}")
                v[key] = [float(x) for x in pair]
        return v

    @model_validator(mode="after")
    def _mode_options(self):
        if self.mode == "epoch" and self.num_samples is not None:
            raise ValueError("data.num_samples is a resampled-mode budget; in data.mode=epoch an epoch is every "
                             "sample once: remove data.num_samples or set data.mode=resampled")
        if self.mode == "epoch" and self.weights is not None and any(w != 1 for w in self.weights):
            raise ValueError("data.weights need data.mode=resampled (epoch mode reads every sample once)")
        if self.weights is not None and (not self.weights or any(w <= 0 for w in self.weights)):
            raise ValueError("data.weights must be positive, one per '::' source of data.train")
        if self.naflex is not None and self.decode == "device":
            raise ValueError("data.decode=device crops square boxes on the device; data.naflex resizes each image "
                             "to its own grid in the workers: set data.decode=worker")
        return self


class LoraSettings(_Strict):
    rank: int = Field(8, gt=0, description="the adapters' rank r")
    alpha: float = Field(16.0, gt=0, description="scale alpha: an adapter adds (alpha / r) x B A to its weight")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    towers: list[Literal["image", "text"]] = Field(["image", "text"], min_length=1,
                                                   description="towers whose blocks get adapters (only those train)")
    modules: list[Literal["attn", "mlp"]] = Field(["mlp"], min_length=1, description="mlp: each block's MLP linears "
                                                  "(frozen weights stay exact); attn: its attention (q, k, v, output; "
                                                  "open_clip's frozen attention weights drift by float rounding)")


class ModelConfig(_Strict):
    arch: str = Field("mmpt-tiny-vit-minilm", description="open_clip architecture name (built-in or packaged)")
    pretrained: str | None = Field(None, description="open_clip pretrained tag or checkpoint file")
    text_model: str | None = Field(
        None, description="Hub ID or local folder for an HF text tower; replaces the arch's hf_model_name"
    )
    lock_text: bool = Field(False, description="freeze the text tower (LiT); its projection stays trainable")
    lock_text_unlocked_layers: int = Field(0, ge=0, description="with lock_text: top text layers left trainable")
    lock_image: bool = Field(False, description="freeze the image tower (LiT with a pretrained image tower)")
    lock_image_unlocked_groups: int = Field(0, ge=0, description="with lock_image: top layer groups left trainable")
    grad_checkpointing: bool = Field(False, description="recompute tower activations in backward (memory)")
    text_from_targets: bool = Field(
        False,
        description="with a locked mean-pooled HF text tower that is also the target encoder, compute text "
        "features as proj(target embedding) instead of re-running the frozen transformer (identical result)",
    )
    overrides: dict[str, Any] = Field(default_factory=dict, description="merged into open_clip's model config")
    patch_dropout: float = Field(0.0, ge=0, lt=1, description="FLIP: the share of an open_clip ViT's patch tokens "
                                 "dropped in training (open_clip's meaning), drawn from the seed, step and sample; "
                                 "evaluation and export unmasked")
    lora: LoraSettings | None = Field(None, description="LoRA adapters (peft) in the towers' blocks: only they train; "
                                      "evaluation and export merge them into the weights")

    @model_validator(mode="after")
    def _seeded_patch_dropout(self) -> ModelConfig:
        if (self.overrides.get("vision_cfg") or {}).get("patch_dropout"):
            raise ValueError("model.overrides.vision_cfg.patch_dropout: open_clip's patch dropout draws from the "
                             "global random stream; set model.patch_dropout instead (seeded per sample and step, so "
                             "grad caching and an exact resume see the same masks)")
        return self

    @model_validator(mode="after")
    def _lora_towers_run(self) -> ModelConfig:
        if self.lora is not None and "text" in self.lora.towers and self.text_from_targets:
            raise ValueError("model.lora.towers includes text, but model.text_from_targets=true never runs the text "
                             "tower: set model.lora.towers=[image] or model.text_from_targets=false")
        return self

    @model_validator(mode="after")
    def _unlocked_needs_locked(self) -> ModelConfig:
        if self.lock_text_unlocked_layers and not self.lock_text:
            raise ValueError("model.lock_text_unlocked_layers needs model.lock_text=true (an unlocked tower trains "
                             "all its layers): set model.lock_text=true or remove lock_text_unlocked_layers")
        if self.lock_image_unlocked_groups and not self.lock_image:
            raise ValueError("model.lock_image_unlocked_groups needs model.lock_image=true (an unlocked tower "
                             "trains all its groups): set model.lock_image=true or remove lock_image_unlocked_groups")
        return self


class TargetsConfig(_Strict):
    model: str = Field(
        DEMO_TEXT_MODEL,
        description="frozen sentence-transformer for similarity targets (Hub ID or local folder)",
    )
    source: Literal["auto", "shards", "online"] = Field(
        "auto", description="shards: the stored caption embeddings (beside the shards, or in-tar {key}.emb.npy); online: encode "
        "captions each step; auto: shards if present"
    )


class LossTerm(_Strict):
    name: str = Field(description="an objective of mmpretrain.losses.LOSSES: clip, sigmoid, soft_target, cwcl, vrn, "
                      "align_uniform, global_clip, regions (docs/methods.md)")
    weight: float = Field(1.0, ge=0, allow_inf_nan=False, description="the term's weight in the sum (0: off)")
    options: dict[str, Any] = Field(default_factory=dict, description="the objective's constructor options, "
                                    "checked when the config loads")


class OptimConfig(_Strict):
    lr: float = Field(1e-3, gt=0, description="peak learning rate (AdamW), after the linear warm-up, then cosine")
    weight_decay: float = Field(0.1, ge=0, description="AdamW's decoupled weight decay; none on biases, norms, "
                                "the logit scale and bias (open_clip's rule)")
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = Field(
        (0.9, 0.98), description="AdamW's (beta1, beta2), each in [0, 1)")
    eps: float = Field(1e-6, gt=0, description="AdamW's epsilon")
    warmup_steps: int | None = Field(None, ge=0, description="default: 10% of total steps")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="cosine floor as a fraction of lr")
    grad_clip_norm: float | None = Field(1.0, gt=0, description="clip the gradient's global norm to this (null: off)")
    layer_decay: float | None = Field(None, gt=0, le=1, description="layer-wise learning-rate decay (BEiT): a layer "
                                      "l of a tower of L blocks trains at lr x layer_decay^(L + 1 - l); embeddings "
                                      "are layer 0, the head L + 1 (null: one rate; 0.65-0.75 is usual for fine-tuning)")
    implementation: Literal["fused", "foreach", "for_loop"] = Field(
        "fused", description="AdamW kernel: fused (one kernel over all parameters, CPU and CUDA; measured 8x faster "
        "than for_loop on this CPU), foreach, or for_loop (torch's CPU default, as open_clip_train)")


class EMAConfig(_Strict):
    decay: float = Field(0.9998, gt=0, lt=1, description="ema <- decay x ema + (1 - decay) x weights after an update")
    every: int = Field(1, gt=0, description="update the average every N optimizer steps")
    warmup_steps: int = Field(0, ge=0, description="until this step the average is a copy of the weights")


class PhaseConfig(_Strict):
    steps: int | None = Field(None, gt=0, description="the phase's optimizer steps (every phase gives steps, summing "
                              "to train.steps, or every phase a share)")
    share: float | None = Field(None, gt=0, le=1, description="the phase's share of the run's steps (the shares sum "
                                "to 1)")
    image_size: int | None = Field(None, gt=0, description="the image tower's input size in the phase (an open_clip "
                                   "ViT: a multiple of its patch; position embeddings resized at the boundary); "
                                   "default: the model's")
    patch_dropout: float | None = Field(None, ge=0, lt=1, description="model.patch_dropout in the phase (default: "
                                        "model.patch_dropout)")
    lr: float | None = Field(None, gt=0, description="the phase's own schedule: warm-up to this rate, cosine to "
                             "optim.min_lr_ratio of it at the phase's end; default: the run's schedule continues")
    warmup_steps: int | None = Field(None, ge=0, description="the phase's own schedule's warm-up (from optim.lr "
                                     "when lr is not given)")

    @model_validator(mode="before")
    @classmethod
    def _same_batch(cls, v: Any) -> Any:
        if isinstance(v, dict) and "batch_size" in v:
            raise ValueError("batch_size: a phase keeps data.batch_size (the data stream's saved position, and so an "
                             "exact resume, is tied to it): remove it, or train the phases as separate runs with "
                             "model.pretrained=CHECKPOINT")
        return v

    @model_validator(mode="after")
    def _length(self) -> PhaseConfig:
        if (self.steps is None) == (self.share is None):
            raise ValueError("give the phase exactly one of steps and share")
        return self


class TrainConfig(_Strict):
    epochs: float | None = Field(None, gt=0, description="epochs of data.num_samples; converted to steps")
    steps: int | None = Field(None, gt=0, description="optimizer steps; exclusive with epochs")
    precision: Literal["no", "fp32", "fp16", "bf16"] = Field(
        "no", description="mixed precision: no (= fp32), bf16 (GPUs, and CPUs: native with AVX-512 BF16 or AMX, "
        "emulated otherwise) or fp16 (GPUs, with loss scaling)")
    log_every: int = Field(10, gt=0, description="a log.jsonl record (and tracker point) every N steps")
    save_every: int | None = Field(None, gt=0, description="checkpoint every K steps (always one at the end)")
    max_logit_scale: float = Field(100.0, gt=1.0, description="the scale is clamped to ln(this) after each step")
    progress: bool = Field(True, description="a progress bar on the main process")
    plots: bool = Field(True, description="the end-of-run plots in the run's plots/ folder (loss, lr and scale, "
                        "geometry, similarity; matplotlib, ~1.4 s at the end of a run on a 2-core CPU)")
    micro_batch_size: int | None = Field(None, gt=0, description="split each rank's batch into micro-batches of "
                                         "this size (memory); see micro_batch_mode")
    micro_batch_mode: Literal["grad_cache", "accumulate"] = Field(
        "grad_cache", description="grad_cache: the whole batch's gradient exactly (towers without BatchNorm); "
        "accumulate: each micro-batch its own objective, gradients averaged (a different objective)")
    log_with: list[Literal["tensorboard", "wandb"]] = Field(
        default_factory=lambda: ["tensorboard"], description="trackers beside log.jsonl (tensorboard writes into "
        "run_dir/mmpretrain/)")
    diagnostics_every: int | Literal["auto"] | None = Field(
        "auto", description="geometry diagnostics of the gathered batch every N steps (alignment, uniformity, "
        "modality gap, negative similarities); auto: about 50 points over the run, on logging steps; null: off")
    keep_last: int = Field(3, gt=0, description="checkpoints kept in run_dir/checkpoints (older ones removed)")
    nonfinite: Literal["stop", "skip"] = Field(
        "stop", description="a non-finite loss: stop (exit 1, no checkpoint of the bad state) or skip the step")
    max_skipped_steps: int = Field(10, ge=0, description="with nonfinite=skip: stop after this many skipped steps")
    compile: bool = Field(False, description="torch.compile the model (accelerate's dynamo plugin, inductor); "
                          "trimmed text lengths are bucketed (text_length_multiple) so it compiles a few shapes")
    channels_last: bool = Field(False, description="model and images in channels-last memory format (faster "
                                "convolutions on GPUs: ResNet towers, a ViT's patch embedding)")
    text_length_multiple: int = Field(8, gt=0, description="trimmed text batches are cut to a multiple of this many "
                                      "tokens (at most the context): few shapes for torch.compile, tensor-core sizes")
    ema: EMAConfig | None = Field(None, description="an exponential moving average of the trained weights, saved in "
                                  "each checkpoint, evaluated beside them, exported with --ema (DDP; not FSDP/DeepSpeed)")
    phases: list[PhaseConfig] | None = Field(None, description="the run in phases, each its steps or share and any of "
                                             "image_size, patch_dropout, its own lr schedule; a checkpoint at each "
                                             "boundary (FLIP's unmasked phase, CLIPA's low-then-high resolution)")

    @field_validator("precision")
    @classmethod
    def _fp32_is_no(cls, v: str) -> str:
        return "no" if v == "fp32" else v

    @field_validator("diagnostics_every", mode="before")
    @classmethod
    def _cadence(cls, v: Any) -> Any:
        if v is None or v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v > 0):
            return v
        raise ValueError("must be a positive number of steps, auto, or null (off)")

    @model_validator(mode="after")
    def _duration(self) -> TrainConfig:
        if (self.epochs is None) == (self.steps is None):
            raise ValueError("set exactly one of train.epochs and train.steps")
        if self.phases:
            by_steps = [p.steps is not None for p in self.phases]
            if any(by_steps) and not all(by_steps):
                raise ValueError("train.phases: give every phase steps, or every phase a share (not a mix)")
            if all(by_steps) and sum(p.steps for p in self.phases) != self.steps:
                raise ValueError(f"train.phases: the phases' steps sum to {sum(p.steps for p in self.phases)}; set "
                                 f"train.steps to that (train.steps={self.steps}, train.epochs={self.epochs})")
            if not any(by_steps) and abs(sum(p.share for p in self.phases) - 1) > 1e-6:
                raise ValueError(f"train.phases: the shares sum to {sum(p.share for p in self.phases):g}, not 1")
        return self


class EvalConfig(_Strict):
    every: int = Field(gt=0, description="run the evaluations every N steps (and at the end), on all ranks")
    datasets: list[str] = Field(min_length=1, description="dataset specs as python -m mmpretrain.eval takes them")
    tasks: list[str] = Field(min_length=1, description="one task for all datasets, or one per dataset")
    batch_size: int = Field(256, gt=0, description="images per evaluation batch (per rank)")
    num_workers: int = Field(2, ge=0, description="DataLoader workers decoding the evaluation images")

    @model_validator(mode="after")
    def _tasks(self):
        if len(self.tasks) not in (1, len(self.datasets)):
            raise ValueError("eval.tasks: give one task, or one per entry of eval.datasets")
        outside.check_tasks(self.tasks)
        return self

    @property
    def jobs(self) -> list[tuple[str, str]]:
        tasks = self.tasks * len(self.datasets) if len(self.tasks) == 1 else self.tasks
        return list(zip(self.datasets, tasks))


class HubConfig(_Strict):
    repo_id: str = Field(description="ORG/NAME on the Hugging Face Hub (token: HF_TOKEN or `hf auth login`)")
    push_every: int | None = Field(None, gt=0, description="upload each checkpoint whose step is a multiple of "
                                   "this into checkpoints/step_N of the repo")
    private: bool = Field(True, description="create the repository private")
    revision: str | None = Field(None, description="the branch to upload to (default: main)")

    @field_validator("repo_id")
    @classmethod
    def _repo_id(cls, v: str) -> str:
        outside.check_repo_id(v)
        return v


class ExperimentConfig(_Strict):
    name: str = Field("run", description="the run's name: its folder (runs/<name>) and tracker run name")
    run_dir: str | None = Field(None, description="default: runs/<name>")
    resume: str | None = Field(None, description="a checkpoint folder (or run folder: its latest) to resume from; "
                               "a run_dir that already holds checkpoints resumes from its latest by itself")
    seed: int = Field(0, description="seeds the model's initialisation, the stream's order and the augmentations")
    data: DataConfig
    model: ModelConfig = Field(default_factory=ModelConfig)
    targets: TargetsConfig = Field(default_factory=TargetsConfig)
    loss: list[LossTerm] = Field(default_factory=lambda: [LossTerm(name="clip")], description="the objective: a "
                                 "weighted sum of named terms, e.g. [{name: clip}, {name: soft_target, weight: 0.5}]")
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainConfig = Field(default_factory=lambda: TrainConfig(epochs=1))
    eval: EvalConfig | None = Field(None, description="evaluations during training (the evaluation suite's tasks)")
    hub: HubConfig | None = Field(None, description="periodic upload of checkpoints to the Hub during training")

    @field_validator("loss")
    @classmethod
    def _objective(cls, v: list[LossTerm]) -> list[LossTerm]:
        """The terms' names and options, checked by building the objective once (one process, stand-ins
        for the sizes the data gives at setup)."""
        if v:
            outside.check_objective([t.model_dump() for t in v])
        return v

    @model_validator(mode="after")
    def _cross(self) -> ExperimentConfig:
        if not self.loss:
            raise ValueError("loss: give at least one term, e.g. [{name: clip}]")
        if self.model.text_from_targets and not self.model.lock_text:
            raise ValueError(
                "model.text_from_targets needs model.lock_text=true (a trained text tower must run every step)"
            )
        if self.model.text_from_targets and self.model.lock_text_unlocked_layers:
            raise ValueError("model.text_from_targets needs the whole text tower locked: "
                             "set model.lock_text_unlocked_layers=0")
        m = self.train.micro_batch_size
        if m is not None and (m >= self.data.batch_size or self.data.batch_size % m):
            raise ValueError(f"train.micro_batch_size={m} must divide data.batch_size={self.data.batch_size} "
                             "and be smaller (or leave it unset)")
        if m is not None and self.train.micro_batch_mode == "accumulate":
            whole = next(iter(outside.whole_batch_terms([t.name for t in self.loss])), None)
            if whole:
                raise ValueError(f"loss {whole} needs the whole batch in one objective call: use "
                                 "train.micro_batch_mode=grad_cache with train.micro_batch_size")
        return self

    @property
    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir) if self.run_dir else Path("runs") / self.name
