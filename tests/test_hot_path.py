"""The training step's hot path: at most one host-device synchronisation per step (the non-finite
check's, which every rank must agree on), counted on CPU where a GPU would wait; geometry diagnostics
bounded whatever the global batch."""

from __future__ import annotations

import shutil
from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import setup_run

# a scalar read (item(), float(), int(), bool() of a tensor) and data-dependent shapes wait for the
# device; host copies (cpu(), tolist(), numpy()) too
SYNC_OPS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
            "aten.unique.default", "aten._unique2.default"}
SYNC_METHODS = {"cpu", "tolist", "numpy"}


class _Counting:
    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()
        self.paused = False

    def count(self, name: str, names: set[str]) -> None:
        if name in names and not self.paused:
            self.counts[name] += 1


class SyncCounter(_Counting, TorchDispatchMode):
    """Counts synchronising ops, in forward and backward (dispatch modes reach autograd's backward)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count(str(func), SYNC_OPS)
        return func(*args, **(kwargs or {}))


class CopyCounter(_Counting, TorchFunctionMode):
    """Counts host copies of tensors (which a dispatch mode does not see on a CPU)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count(getattr(func, "__name__", ""), SYNC_METHODS)
        return func(*args, **(kwargs or {}))


CONFIGS = {
    "demo": [],
    "trained_text_tiled": ["model.arch=mmpt-tiny-vit", "model.lock_text=false", "model.text_from_targets=false",
                           "loss=[{name: clip, options: {chunk_size: 8}}, "
                           "{name: soft_target, weight: 0.5, options: {chunk_size: 8}}]"],
    "sigmoid_tiled": ["loss=[{name: sigmoid, options: {chunk_size: 8}}]"],
    "grad_cache": ["model.arch=mmpt-tiny-vit", "model.lock_text=false", "model.text_from_targets=false",
                   "train.micro_batch_size=8"],
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_at_most_one_host_sync_per_step(openmoji, tmp_path, name, monkeypatch):
    from mmpretrain.train import loop, train_step

    run = setup_run(openmoji / "train", tmp_path / name, "train.steps=10", "data.batch_size=16", "data.num_workers=0",
                    *CONFIGS[name])
    batches = iter(run.loader)
    train_step(run, next(batches))  # the first step may set things up
    run.state.step += 1
    batch = next(batches)
    syncs, copies = SyncCounter(), CopyCounter()
    trim = loop.trim_padding

    def on_the_host(tokens, *args):
        # the loader's own batch, before its copy to the device: its reads do not wait for a GPU
        assert tokens is batch["tokens"]
        syncs.paused = copies.paused = True
        try:
            return trim(tokens, *args)
        finally:
            syncs.paused = copies.paused = False

    monkeypatch.setattr(loop, "trim_padding", on_the_host)
    with syncs, copies:
        train_step(run, batch)
    assert sum(syncs.counts.values()) + sum(copies.counts.values()) <= 1, (dict(syncs.counts), dict(copies.counts))
    shutil.rmtree(tmp_path / name, ignore_errors=True)


def test_geometry_diagnostics_are_bounded():
    """A 64k global batch must not build 64k^2 float64 matrices: the measures use the first 4,096
    rows, in float32."""
    from mmpretrain.train.diagnostics import GEOMETRY_ROWS, geometry

    assert GEOMETRY_ROWS == 4096
    g = torch.Generator().manual_seed(0)
    x = torch.nn.functional.normalize(torch.randn(GEOMETRY_ROWS + 904, 16, generator=g), dim=-1)
    y = torch.nn.functional.normalize(x + torch.randn(x.shape, generator=g), dim=-1)

    class Float64(TorchDispatchMode):
        seen = False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            Float64.seen |= any(isinstance(o, torch.Tensor) and o.dtype == torch.float64
                                for o in (out if isinstance(out, (tuple, list)) else [out]))
            return out

    with Float64():
        big = geometry(x, y)
    assert big == geometry(x[:GEOMETRY_ROWS], y[:GEOMETRY_ROWS])
    assert not Float64.seen
