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


def device_times(fn, device, repeats: int = 3) -> dict:
    """Median host ms to issue ``fn`` and device ms to run it (CUDA events on the current stream; on a
    CPU, where every operator is synchronous, the wall time), over ``repeats`` calls."""
    import statistics
    import time

    import torch

    host, dev = [], []
    for _ in range(repeats):
        sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        if device.type == "cuda":
            end.record()
            end.synchronize()
            dev.append(start.elapsed_time(end))
        else:
            dev.append(host[-1])
    return {"host_ms": round(statistics.median(host), 2), "device_ms": round(statistics.median(dev), 2)}
