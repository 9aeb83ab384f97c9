"""Every host tensor a piece of code sends to a device, as a test or the GPU check sees it: a torch
function mode that records each ``Tensor.to`` / ``.cuda`` / ``copy_`` whose source is on the host and
whose target names a device, with the source's contiguity and whether it is pinned. On CUDA a copy from
pageable or non-contiguous memory makes the stream wait for the host, and ``set_sync_debug_mode`` does
not count it; this does."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode


@dataclass
class Copy:
    shape: tuple[int, ...]
    dtype: torch.dtype
    contiguous: bool
    pinned: bool
    target: str
    caller: str  # file:line of the Python code that asked for it

    @property
    def pageable(self) -> bool:
        """A copy that synchronises the host on CUDA: from pageable memory or through a temporary."""
        return not (self.contiguous and self.pinned)


def _target(func, args, kwargs) -> torch.device | None:
    if func is torch.Tensor.cuda:
        return torch.device("cuda")
    if func is torch.Tensor.copy_:
        return args[0].device
    for a in [*args[1:], kwargs.get("device"), kwargs.get("other")]:
        if isinstance(a, torch.device):
            return a
        if isinstance(a, str) and not a.startswith("torch."):
            try:
                return torch.device(a)
            except RuntimeError:
                continue
        if isinstance(a, torch.Tensor):
            return a.device
    return None


@dataclass
class CopyAudit(TorchFunctionMode):
    """``with CopyAudit(prefix) as audit: ...`` then ``audit.copies``: the host-to-device copies asked
    for by code whose file path contains ``prefix`` (default: this project's package)."""

    prefix: str = "/mmpretrain/"
    copies: list[Copy] = field(default_factory=list)

    def __post_init__(self):
        super().__init__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.copy_):
            src = args[1] if func is torch.Tensor.copy_ else args[0]
            target = _target(func, args, kwargs)
            frame = sys._getframe(1)
            while frame.f_back is not None and frame.f_code.co_filename.endswith("/data/transfer.py"):
                frame = frame.f_back  # who asked, not the helper
            caller = f"{frame.f_code.co_filename}:{frame.f_lineno}"
            if (isinstance(src, torch.Tensor) and src.device.type == "cpu" and target is not None
                    and self.prefix in frame.f_code.co_filename):
                self.copies.append(Copy(tuple(src.shape), src.dtype, src.is_contiguous(),
                                        src.is_pinned() if torch.cuda.is_available() else False, str(target), caller))
        return func(*args, **kwargs)
