"""What the GPU check's two scripts share (gpu_bench.py runs the sections, gpu_end_to_end.py the end-to-end
part of its step section): the checkout's root on ``sys.path`` (the device machine runs the checkout;
mmpretrain is not pip-installed there), a device synchronisation and a FLOP count. Both import this;
neither imports the other's helpers."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def count_flops(fn) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()
