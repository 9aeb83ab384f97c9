"""Host-to-device copies that never synchronise the host. A copy from pageable memory, or from a
non-contiguous view (which goes through a contiguous pageable temporary), makes the CUDA stream wait
for the host even with ``non_blocking=True``, and torch's ``set_sync_debug_mode`` does not report it.
The loader's batches arrive pinned (its pin-memory thread); what the step makes on the host itself
(the device decoder's boxes and slots, patch-dropout masks) is pinned here before it goes."""

from __future__ import annotations

import torch

from mmpretrain.data import host_memory


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device``, asynchronously: a host tensor bound for CUDA is made contiguous and pinned
    first where it is not (both host-side copies, no stream wait) -- up to the loader's own pinning
    limit (:func:`~mmpretrain.data.host_memory.pin`): a larger batch is copied as the loader left it."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        if not t.is_contiguous():
            t = t.contiguous()
        if not t.is_pinned() and host_memory.pin(t.nbytes):
            t = t.pin_memory()
    return t.to(device, non_blocking=True)


def cut_on_device(t: torch.Tensor, length: int, device: torch.device | str) -> torch.Tensor:
    """``t[:, :length]`` on ``device``: the (pinned, contiguous) host tensor copied whole and cut there.
    Cutting on the host first would make the copy's source a non-contiguous view."""
    out = to_device(t, device)
    return out if length == out.shape[1] else out[:, :length].contiguous()
