"""Run a command of this project under accelerate's FSDP or DeepSpeed engine on CPU gloo ranks.

accelerate refuses both engines on a machine without a GPU: its process-group setup picks no
backend when ``cpu=False`` and there is no CUDA, and with ``cpu=True`` it silently runs plain
data parallelism instead. This wrapper changes two things in accelerate's ``PartialState``: the
backend (gloo, as for several GPUs) and the device (the CPU); and one in torch's FSDP1 on a CPU
device (below). Everything else
-- accelerate's FSDP wrapping, its ``save_state``/``load_state``, DeepSpeed's engine and ZeRO
optimizer (on DeepSpeed's CPU accelerator, ``DS_ACCELERATOR=cpu``) -- is the real code users run on
GPUs, driving this project's trainer unchanged.

    accelerate launch --config_file configs/accelerate/fsdp.yaml --num_processes 2 \
        --fsdp_sync_module_states false tests/scripts/gpu_engine_on_cpu.py mmpretrain.train --config ...

or, for several runs in one launch, ``tests/scripts/ddp_checks.py PLAN`` instead of the module.

(``fsdp_sync_module_states`` broadcasts from a CUDA device; every rank builds the same seeded
weights here anyway.) Used by tests/test_engines.py.
"""

from __future__ import annotations

import os
import runpy
import sys

import torch
from accelerate.state import PartialState
from accelerate.utils import DistributedType


def _prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
    return "gloo", DistributedType.MULTI_GPU


def _set_device(self):
    if self.device is None:
        self.device = torch.device("cpu")


def _copying_unflatten(original):
    """torch 2.14's FSDP1 full optimizer state dict gathers every state (``exp_avg``, ``exp_avg_sq``)
    into one reused buffer and relies on ``.cpu()`` (``offload_to_cpu``, as accelerate configures it)
    to copy each out; on a CPU device ``.cpu()`` is a no-op, so every state aliases the last one
    gathered (measured: ``exp_avg`` saved equal to ``exp_avg_sq``, and a resume that diverges at its
    second step). On a GPU the copy happens. Here the no-offload branch, which clones, is taken."""

    def unflatten(fsdp_param_info, output_states, state_name, shard_state, to_save, cpu_offload):
        on_cpu = fsdp_param_info.state.compute_device.type == "cpu"
        return original(fsdp_param_info, output_states, state_name, shard_state, to_save, cpu_offload and not on_cpu)

    return unflatten


def main() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    PartialState._prepare_backend = _prepare_backend
    PartialState.set_device = _set_device
    from torch.distributed.fsdp import _optim_utils

    _optim_utils._unflatten_orig_param_states = _copying_unflatten(_optim_utils._unflatten_orig_param_states)
    import mmpretrain.train.engine as engine

    engine.on_cpu = lambda: False  # the trainer asks accelerate for its GPU path
    target, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
    if target.endswith(".py"):  # a script of several runs (tests/scripts/ddp_checks.py), by path
        runpy.run_path(target, run_name="__main__")
    else:
        runpy.run_module(target, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
