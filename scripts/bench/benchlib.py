"""Shared helpers for scripts/bench/bench_*.py: a loss-internal memory counter, timing, the JSON schema."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

RESULTS = Path(__file__).resolve().parents[2] / "bench_results"


class PeakTensorMemory(TorchDispatchMode):
    """Peak bytes of tensor storage created by ops run under this mode and still alive.

    Every op's outputs are seen here (forward, backward and custom autograd Functions alike); a
    storage counts from its first appearance until the last tensor viewing it is freed. Tensors
    created before the mode (the inputs) are not counted."""

    def __init__(self, exclude: tuple[torch.Tensor, ...] = ()):
        super().__init__()
        # storages of the inputs (and their pre-allocated .grad) are not the loss's memory
        self.external = {t.untyped_storage().data_ptr() for t in exclude}
        self.live = 0
        self.peak = 0
        self.refs: dict[int, list[int]] = {}  # storage data_ptr -> [nbytes, live tensors]
        self.at_peak: dict[int, int] = {}  # storage -> nbytes of what was alive at the peak

    def _release(self, key: int) -> None:
        entry = self.refs.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self.refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                st = t.untyped_storage()
                key, nbytes = st.data_ptr(), st.nbytes()
                if nbytes == 0 or key in self.external:
                    continue
                if key not in self.refs:
                    self.refs[key] = [nbytes, 0]
                    self.live += nbytes
                    if self.live > self.peak:
                        self.peak = self.live
                        self.at_peak = {k: v[0] for k, v in self.refs.items()}
                self.refs[key][1] += 1
                weakref.finalize(t, self._release, key)
        return out


def measure(fn, inputs: tuple[torch.Tensor, ...], repeats: int = 3) -> tuple[list[float], int]:
    """``fn()`` runs forward+backward of a loss on ``inputs`` (leaf tensors); returns the wall times
    and the loss-internal peak bytes of one more run: the inputs, their pre-allocated ``.grad`` and the
    gradient tensors delivered to them are excluded (docs/performance.md: "excluding the inputs and their
    gradients")."""
    times = []
    for _ in range(repeats):
        for t in inputs:
            t.grad = None
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    for t in inputs:
        t.grad = torch.zeros_like(t)
    delivered: list[int] = []  # storages of the gradients handed to the inputs
    hooks = [t.register_hook(lambda g: delivered.append(g.untyped_storage().data_ptr())) for t in inputs]
    with PeakTensorMemory(exclude=inputs + tuple(t.grad for t in inputs)) as mem:
        fn()
    for h in hooks:
        h.remove()
    # the inputs' gradients are excluded too: subtract those alive at the peak
    return times, mem.peak - sum(mem.at_peak.get(k, 0) for k in set(delivered))


def write_result(name: str, ratio: float, higher_is_better: bool, target: float, runs: list[float],
                 extra: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    data = {"ratio": round(ratio, 4), "higher_is_better": higher_is_better, "target": target,
            "runs": [round(r, 4) for r in runs], "spread": [round(min(runs), 4), round(max(runs), 4)],
            "command": "python " + " ".join([f"scripts/bench/{Path(sys.argv[0]).name}", *sys.argv[1:]]),
            "extra": extra}
    try:
        data["extra"]["git_sha"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                                  text=True).stdout.strip() or None
    except OSError:
        pass
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def interleaved(fns: dict, repeats: int, iters: int, warmup: int = 2) -> dict[str, list[float]]:
    """Seconds per call of each zero-argument ``fns`` value, one figure per repeat: the functions take turns
    within every repeat (``warmup`` untimed calls, then ``iters`` timed), so drift on the machine touches every
    row alike."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            for _ in range(warmup):
                fn()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            times[name].append((time.perf_counter() - t0) / iters)
    return times


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def table(rows: list[tuple], header: tuple) -> str:
    rows = [tuple(str(c) for c in header)] + [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def report_ratio(name: str, ref_runs: list[float], our_runs: list[float], labels: tuple[str, str], target: float,
                 extra: dict) -> float:
    """Print the per-run table of an A/B throughput bench (ratio = ours / reference, higher is better)
    and write ``bench_results/<name>.json``; returns the median ratio."""
    ratios = [o / r for o, r in zip(our_runs, ref_runs)]
    rows = [(i + 1, f"{r:.1f}", f"{o:.1f}", f"{q:.3f}") for i, (r, o, q) in enumerate(zip(ref_runs, our_runs, ratios))]
    print(table(rows, ("run", *labels, "ratio")))
    path = write_result(name, median(ratios), True, target, ratios, extra)
    print(f"ratio {median(ratios):.3f} -> {path}")
    return median(ratios)


def open_clip_rate(pattern: str, transform, tokenizer, batch_size: int, workers: int, epochs: int) -> float:
    """Images/s of open_clip_train's ``get_wds_dataset`` over ``epochs`` passes of the shards ``pattern``
    (worker start included)."""
    from argparse import Namespace

    from open_clip_train.data import get_wds_dataset

    a = Namespace(train_data=pattern, train_num_samples=None, dataset_resampled=False,
                  train_data_upsampling_factors=None, seed=0, batch_size=batch_size, world_size=1, workers=workers)
    t0 = time.perf_counter()
    info = get_wds_dataset(a, transform, is_train=True, epoch=0, tokenizer=tokenizer)
    seen = 0
    for e in range(epochs):
        info.set_epoch(e)
        for images, _texts in info.dataloader:
            seen += images.shape[0]
    dt = time.perf_counter() - t0
    del info
    return seen / dt


def trainer_plan(sources, batch_size: int, workers: int, mode: str = "epoch", num_samples: int | None = None,
                 shuffle_buffer: int = 1000):
    """The trainer's stream plan over ``sources`` for one rank: ``mmpretrain.train.inputs.build_data`` on the
    demo config with these ``data.*`` settings (what ``python -m mmpretrain.train`` would plan), not a plan
    wired by hand."""
    from mmpretrain.config import load_config
    from mmpretrain.train.inputs import build_data

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs/demo.yaml", [
        "data.train=unused", f"data.mode={mode}", f"data.batch_size={batch_size}", f"data.num_workers={workers}",
        f"data.shuffle_buffer={shuffle_buffer}", f"data.num_samples={num_samples or 'null'}", "seed=0"])
    return build_data(cfg, sources, 1).plan


def stream_rate(sources, transform, tokenizer, batch_size: int, workers: int, epochs: int, decode: str = "worker",
                device: str = "cpu") -> float:
    """Images/s of our training stream (epoch mode, one rank) over ``epochs`` passes (worker start included),
    with open_clip's training ``transform`` split as the trainer splits it (the fast crop path, uint8 out,
    normalised on the device). ``decode="device"``: data.decode=device, each batch's JPEGs decoded,
    cropped and resized on ``device`` in this process as the trainer does (one batch ahead on a background
    thread, on its own stream on CUDA), synchronised before the clock stops."""
    import torch

    from mmpretrain.data.decode import SampleDecoder, split_normalize
    from mmpretrain.data.device_decode import DeviceDecoder, Prefetcher
    from mmpretrain.data.stream import TrainStream, make_loader

    plan = trainer_plan(sources, batch_size, workers)
    crop = split_normalize(transform, fast=True)[0]
    decoder = SampleDecoder(crop, embeddings="ignore", device_decode=decode == "device")
    t0 = time.perf_counter()
    it = iter(make_loader(TrainStream(plan, decoder, 0, tokenizer=tokenizer), workers))
    if decode == "device":
        it = Prefetcher(it, DeviceDecoder(crop, device))
    seen = 0
    for _ in range(plan.steps_per_epoch * epochs):
        seen += next(it).images.shape[0]
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    if isinstance(it, Prefetcher):
        it.close()
    del it
    return seen / dt
