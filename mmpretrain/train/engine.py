"""The engine a run trains under, in one place: accelerate's Accelerator for this machine and config (CPU
or GPU, precision, trackers, torch.compile), which engine that is (:func:`engine_name`, read from the
accelerator and nowhere else), what FSDP and DeepSpeed need set or refused before the model is prepared,
the dtype the batch's images take, and the full weights of a sharded model for calls outside its forward
(:func:`full_weights`)."""

from __future__ import annotations

import contextlib
import os
import sys
from contextlib import ExitStack

import torch
from accelerate import Accelerator

from mmpretrain.config import ConfigError, ExperimentConfig
from mmpretrain.train.schedule import Schedule

# the engines that shard the weights between ranks, by accelerate's name, as users write them
SHARDED = {"FSDP": "FSDP", "DEEPSPEED": "DeepSpeed"}


def engine_name(accelerator) -> str:
    """The engine this run trains under: accelerate's ``DistributedType`` as its bare name (``FSDP``,
    ``DEEPSPEED``, ``MULTI_GPU``, ``MULTI_CPU``, ``NO``), decided by the accelerator."""
    return str(accelerator.distributed_type).rsplit(".", 1)[-1]


def sharded_engine(accelerator) -> str | None:
    """``FSDP`` or ``DeepSpeed`` when the run's weights are sharded between ranks, else None."""
    return SHARDED.get(engine_name(accelerator))


def on_cpu() -> bool:
    """Whether accelerate is to run on the CPU (no GPU here). tests/scripts/gpu_engine_on_cpu.py
    replaces it to drive accelerate's FSDP and DeepSpeed paths on CPU gloo ranks."""
    return not torch.cuda.is_available()


def set_tf32(enabled: bool) -> dict[str, bool]:
    """TF32 for fp32 matmuls (cuBLAS) and convolutions (cuDNN), on or off; returns the setting it
    replaced (:func:`tf32` gives it back). One API only, the ``allow_tf32`` flags: torch refuses to read
    a setting made through both it and the newer ``fp32_precision`` one, and inductor (torch.compile),
    accelerate (dynamo in fp32) and open_clip_train still use ``allow_tf32`` (torch issue 166387), so
    writing ``fp32_precision`` here would break them."""
    before = tf32_state()
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    return before


def tf32_state() -> dict[str, bool]:
    """The TF32 setting in force: ``{"matmul": ..., "cudnn": ...}``."""
    return {"matmul": bool(torch.backends.cuda.matmul.allow_tf32), "cudnn": bool(torch.backends.cudnn.allow_tf32)}


@contextlib.contextmanager
def tf32(enabled: bool):
    """TF32 on or off for the block, the earlier setting restored after it."""
    before = set_tf32(enabled)
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before["matmul"]
        torch.backends.cudnn.allow_tf32 = before["cudnn"]


def make_accelerator(cfg: ExperimentConfig) -> Accelerator:
    cpu = on_cpu()
    if cfg.train.precision == "fp16" and cpu:  # accelerate's loss scaling needs one
        raise ConfigError("train.precision=fp16 needs a GPU; on a CPU use train.precision=bf16 (autocast) or no")
    launched = os.environ.get("ACCELERATE_MIXED_PRECISION")  # the accelerate config's mixed_precision
    wanted = cfg.train.precision  # "fp32" is normalised to "no" by the config (TrainConfig), nowhere else
    if launched and launched != wanted and os.environ.get("RANK", "0") == "0":
        print(f"note: train.precision={cfg.train.precision} decides the precision; the accelerate config's "
              f"mixed_precision={launched} is not used (set train.precision={launched} for it)", file=sys.stderr)
    engine = _launched_engine()
    if engine and cpu:  # with cpu=True accelerate would silently train without the engine
        raise ConfigError(f"the accelerate config asks for {engine}, which needs GPUs; this machine has none. "
                          "Launch with configs/accelerate/cpu-2proc.yaml (gloo data parallelism) on a CPU")
    if not cpu:  # open_clip_train's GPU defaults: TF32 matmuls and convolutions, cuDNN autotuning
        set_tf32(True)
        torch.backends.cudnn.benchmark = True
    dynamo = None
    if cfg.train.compile:
        from accelerate.utils import TorchDynamoPlugin

        dynamo = TorchDynamoPlugin(backend="inductor")
    try:
        return Accelerator(cpu=cpu, mixed_precision=cfg.train.precision, dynamo_plugin=dynamo,
                           log_with=list(cfg.train.log_with) or None, project_dir=str(cfg.resolved_run_dir))
    except (ValueError, ImportError) as e:
        if cfg.train.log_with and any(t in str(e).lower() for t in (*cfg.train.log_with, "tracker")):
            raise ConfigError(f"train.log_with={cfg.train.log_with}: {e} (pip install the tracker, or drop it)") from None
        raise ConfigError(f"accelerate cannot start this run (train.precision={cfg.train.precision}): {e}") from None


def configure_engine(cfg: ExperimentConfig, acc: Accelerator, schedule: Schedule) -> None:
    """What FSDP and DeepSpeed need from this config, set or refused before the model is prepared.

    DeepSpeed: accelerate fills ``train_micro_batch_size_per_gpu: auto`` from a prepared DataLoader,
    which this trainer does not use (its stream is its own), so the batch sizes are set from the
    schedule's; the engine clips gradients itself, so its ``gradient_clipping`` is set from
    ``optim.grad_clip_norm`` (a config file's value would silently win otherwise); its ``backward``
    also steps the optimizer, so micro-batches (several backwards per step) and engine-side gradient
    accumulation are refused."""
    if engine_name(acc) != "DEEPSPEED":
        return
    if cfg.train.micro_batch_size:
        raise ConfigError(f"train.micro_batch_size={cfg.train.micro_batch_size} under DeepSpeed: its backward steps "
                          "the optimizer, so gradient caching or accumulation would take one optimizer step per "
                          "micro-batch. Remove train.micro_batch_size, or launch with configs/accelerate/fsdp.yaml "
                          "or 8gpu.yaml (DDP), where micro-batches are exact")
    ds = acc.state.deepspeed_plugin.deepspeed_config
    if ds.get("gradient_accumulation_steps", 1) not in (1, "auto"):
        raise ConfigError(f"the DeepSpeed config sets gradient_accumulation_steps={ds['gradient_accumulation_steps']}: "
                          "this trainer takes one optimizer step per batch; set it to 1 (a bigger batch: "
                          "data.batch_size, or train.micro_batch_size under DDP/FSDP)")
    ds.update(train_micro_batch_size_per_gpu=schedule.batch_size, gradient_accumulation_steps=1,
              train_batch_size=schedule.global_batch_size,
              gradient_clipping=cfg.optim.grad_clip_norm or 0.0)


def input_dtype(acc: Accelerator) -> torch.dtype | None:
    """The dtype the batch's images must have: DeepSpeed under bf16/fp16 holds the weights in it and
    runs without autocast; every other engine takes fp32 images (autocast casts)."""
    if engine_name(acc) == "DEEPSPEED" and acc.mixed_precision in ("bf16", "fp16"):
        return torch.bfloat16 if acc.mixed_precision == "bf16" else torch.float16
    return None


def _launched_engine() -> str | None:
    """``FSDP`` or ``DeepSpeed`` when ``accelerate launch`` was given such a config (its environment): read
    only to refuse it on a CPU, where accelerate would otherwise train without it. Once the accelerator
    exists, :func:`engine_name` says which engine runs."""
    for var, name in (("ACCELERATE_USE_FSDP", "FSDP"), ("ACCELERATE_USE_DEEPSPEED", "DeepSpeed")):
        if os.environ.get(var, "false").lower() == "true":
            return name
    return None


def gathered_weights(accelerator, model: torch.nn.Module, checkpoint, engine: str) -> dict | None:
    """The full weights of an FSDP- or DeepSpeed-prepared model for a checkpoint (call on every rank; the
    main process gets them, the others None). FSDP: accelerate's gathered state dict. DeepSpeed: the fp32
    master weights from the ZeRO checkpoint just written into ``checkpoint`` (the module itself holds
    bf16/fp16 copies under mixed precision)."""
    if engine == "DEEPSPEED":
        accelerator.wait_for_everyone()  # every rank's optimizer partition is on disk
        if not accelerator.is_main_process:
            return None
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag="pytorch_model")
    return accelerator.get_state_dict(model)


@contextlib.contextmanager
def full_weights(accelerator, model: torch.nn.Module):
    """The unwrapped module with its full weights, for calls outside the prepared model's forward
    (evaluation runs ``encode_image``/``encode_text``). FSDP shards the parameters between forwards:
    they are gathered for the duration (no write-back), FSDP1 with ``summon_full_params``, FSDP2 with
    ``unshard``/``reshard``; every other engine holds them whole already. Under bf16/fp16, FSDP's
    mixed-precision policy (its buffers, FSDP2's gathered parameters) and DeepSpeed's weights are half
    precision while the evaluator's images are fp32: the calls run under autocast there, and on GPUs
    under bf16/fp16 whatever the engine (as open_clip_train evaluates); DDP on a CPU stays fp32."""
    inner = accelerator.unwrap_model(model)
    engine = engine_name(accelerator)
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(accelerator.mixed_precision))
    with ExitStack() as stack:
        if half is not None and (engine in SHARDED or accelerator.device.type == "cuda"):
            stack.enter_context(torch.autocast(accelerator.device.type, dtype=half))
        if engine == "FSDP":
            from torch.distributed.fsdp import FSDPModule
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

            if isinstance(model, FSDP1):
                stack.enter_context(FSDP1.summon_full_params(model, writeback=False, recurse=True))
            else:
                sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
                for m in sharded:
                    m.unshard()
                stack.callback(lambda: [m.reshard() for m in sharded])
        yield inner
