"""What the GPU check's scripts share (gpu_bench.py runs the sections of gpu_sections.py and gpu_engines.py,
gpu_end_to_end.py the end-to-end part of its step section): the checkout's root (bench_gpu.sh puts it on
PYTHONPATH: mmpretrain is not pip-installed on the device machine), a device synchronisation and a FLOP
count. gpu_end_to_end.py imports only this of its siblings."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def count_flops(fn) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()
