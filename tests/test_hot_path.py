"""The training step's hot path: no host-device synchronisation in a step that does not log (the
non-finite decision stays on the device with fused AdamW, mmpretrain/train/nonfinite.py), counted on CPU
where a GPU would wait, by operator (what the dispatcher sees: scalar reads, data-dependent shapes) and by
Python call (Tensor.item, __bool__, __float__, tolist, cpu, numpy on any tensor); one per step with an
optimizer kernel that cannot skip on the device; geometry diagnostics bounded whatever the global batch."""

from __future__ import annotations

import shutil
from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import ROOT, setup_run

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
    "soft_target_cwcl_vrn": ["loss=[{name: soft_target}, {name: cwcl, weight: 0.5}, {name: vrn, weight: 0.5}]"],
    "global_clip": ["loss=[{name: global_clip}]"],
    # clustered after the first step (a full bank of 16), region terms active in the step counted
    "regions": ["loss=[{name: regions, options: {base: clip, scales: [2, 4], bank_size: 16, refresh_every: 100}}]"],
    "device_decode": ["data.decode=device", "train.precision=bf16"],
    # optim.layer_decay: 17 groups, each its own rate set from the host's schedule
    "layer_decay": ["optim.layer_decay=0.75"],
    # foreach AdamW cannot skip an update on the device: the decision is read on the host, once
    "foreach": ["optim.implementation=foreach"],
}


class PythonReads:
    """Counts the Python-level reads of a tensor's value (what waits for a GPU), by name."""

    NAMES = ("item", "__bool__", "__float__", "__int__", "tolist", "cpu", "numpy")

    def __init__(self, monkeypatch):
        self.counts: Counter = Counter()
        self.on = False
        for name in self.NAMES:
            real = getattr(torch.Tensor, name)

            def counted(t, *a, _real=real, _name=name, **k):
                if self.on:
                    self.counts[_name] += 1
                return _real(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, counted)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_no_host_sync_in_a_step_that_does_not_log(openmoji, tmp_path, name, monkeypatch):
    _no_sync(openmoji / "train", tmp_path, name, CONFIGS[name], monkeypatch)


def test_no_host_sync_in_a_distill_step(teacher_data, tmp_path, monkeypatch):
    """distill (DataCompDR) from the stored teacher rows: none either."""
    from conftest import TEACHER

    _no_sync(teacher_data["data"], tmp_path, "distill", [*TEACHER, "loss=[{name: clip}, {name: distill}]"],
             monkeypatch)


def test_no_host_sync_in_a_naflex_step(openmoji, tmp_path, monkeypatch):
    """configs/tiny/naflex.yaml: timm's NaFlexVit reads each sample's grid back from the device (2 .item()
    per sample, 56 at 28 samples) unless the patch coordinates carry the grids the loader read on the host
    (mmpretrain.models.naflex.grid_sizes)."""
    from mmpretrain.data.naflex import GRIDS

    run = _no_sync(openmoji / "train", tmp_path, "naflex", [], monkeypatch, config=ROOT / "configs/tiny/naflex.yaml",
                   keep=True)
    from mmpretrain.data.naflex import patch_rows

    monkeypatch.undo()  # the counters off
    batch = next(iter(run.loader))
    coord = run.images(batch, run.accelerator.device)["patch_coord"]
    ys, xs = coord[..., 0].amax(1) + 1, coord[..., 1].amax(1) + 1  # timm's own computation
    assert getattr(coord, GRIDS) == [(int(h.item()), int(w.item())) for h, w in zip(ys, xs)]
    part = patch_rows({"patches": coord, "patch_coord": coord, "patch_valid": coord}, slice(2, 5))
    assert getattr(part["patch_coord"], GRIDS) == getattr(coord, GRIDS)[2:5]


def _no_sync(data, tmp_path, name, overrides, monkeypatch, config=None, keep=False):
    from mmpretrain.data import image_input
    from mmpretrain.train import task, train_step

    run = setup_run(data, tmp_path / name, "train.steps=10", "data.batch_size=16", "data.num_workers=0", *overrides,
                    **({"config": config} if config else {}))
    batches = iter(run.loader)
    train_step(run, next(batches))  # the first step may set things up
    run.state.step += 1
    batch = next(batches)
    syncs, copies = SyncCounter(), CopyCounter()
    trim = task.padded_length

    reads = PythonReads(monkeypatch)

    def on_the_host(tokens, *args):
        # the loader's own batch, before its copy to the device: its reads do not wait for a GPU
        assert tokens is batch.tokens or tokens is batch.negative_tokens
        syncs.paused = copies.paused = True
        reads.on = False
        try:
            return trim(tokens, *args)
        finally:
            syncs.paused = copies.paused = False
            reads.on = True

    monkeypatch.setattr(task, "padded_length", on_the_host)
    grids = image_input.host_grids

    def grids_on_the_host(coord):  # data.naflex: the loader's coordinates, read before their copy
        assert coord is batch.patch_coord
        syncs.paused = copies.paused = True
        reads.on = False
        try:
            return grids(coord)
        finally:
            syncs.paused = copies.paused = False
            reads.on = True

    monkeypatch.setattr(image_input, "host_grids", grids_on_the_host)
    if run.images.decoder is not None:  # decoded ahead on fit's background thread, not in the step
        run.images.decoder(batch)
        assert batch.images.dtype == torch.float32
    reads.on = True
    with syncs, copies:
        train_step(run, batch)
    reads.on = False
    found = dict(syncs.counts) | dict(copies.counts) | {f"Tensor.{k}": v for k, v in reads.counts.items()}
    if name == "foreach":  # read on the host each step (torch's foreach AdamW also reads its CPU step counts)
        assert not run.nonfinite.on_device and syncs.counts["aten._local_scalar_dense.default"] >= 1
    else:
        assert run.nonfinite.on_device and not sum(syncs.counts.values()) and not sum(reads.counts.values()), found
    if keep:
        return run
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
