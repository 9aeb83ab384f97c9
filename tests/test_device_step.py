"""data.decode=device on the step path (mmpretrain/data/device_decode.py, resample.py): decoding runs on
a background thread while the step runs, its errors reach the training thread, the crop stage issues the
same number of operator calls whatever the batch size, and a device decoder that does not work stops the
run in one line instead of decoding on the host behind a "device" label."""

from __future__ import annotations

import functools
import threading

import pytest
import torch

from mmpretrain.data.crop import ResizedCrop
from mmpretrain.data.device_decode import DeviceDecoder, Prefetcher
from mmpretrain.testing.photos import make_jpegs, write_shards

from conftest import TEACHER, train


class _Handshake:
    """A decoder whose batch k + 1 cannot finish before step k has begun, while step k waits for decode
    k + 1 to begin: run one after the other on one thread, it could never finish (each wait times out)."""

    device = torch.device("cpu")

    def __init__(self, n: int, fail_at: int | None = None):
        self.began = [threading.Event() for _ in range(n)]  # decode k began
        self.stepping = [threading.Event() for _ in range(n)]  # step k began
        self.overlapped: list[bool] = []
        self.threads: set[str] = set()
        self.fail_at = fail_at

    def __call__(self, batch):
        k = batch["k"]
        self.threads.add(threading.current_thread().name)
        self.began[k].set()
        if k == self.fail_at:
            raise ZeroDivisionError(f"decoding batch {k} failed")
        if k:
            self.overlapped.append(self.stepping[k - 1].wait(timeout=10))
        batch["images"] = torch.zeros(1)
        return batch


def test_decoding_runs_beside_the_step_not_before_it():
    n = 6
    dec = _Handshake(n)
    it = Prefetcher([{"k": k} for k in range(n)], dec)
    waited = []
    for k in range(n):
        batch = next(it)
        assert batch["k"] == k
        dec.stepping[k].set()  # the step begins ...
        if k + 1 < n:  # ... and runs while batch k + 1 is decoded
            waited.append(dec.began[k + 1].wait(timeout=10))
    with pytest.raises(StopIteration):
        next(it)
    assert all(waited) and dec.overlapped == [True] * (n - 1)
    assert dec.threads == {"mmpretrain-device-decode"}  # never the training thread


def test_an_error_while_decoding_reaches_the_training_thread_at_its_batch():
    dec = _Handshake(4, fail_at=2)
    it = Prefetcher([{"k": k} for k in range(4)], dec)
    assert next(it)["k"] == 0
    dec.stepping[0].set()
    assert next(it)["k"] == 1
    dec.stepping[1].set()
    with pytest.raises(ZeroDivisionError, match="decoding batch 2 failed"):
        next(it)


def _count_ops(fn) -> int:
    """Operator calls ``fn`` makes (top level: what Python issues; on CUDA each is a launch or a few)."""
    from torch.profiler import profile

    with profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.cpu_parent is None)


def test_the_crop_stage_issues_the_same_operator_calls_at_64_and_256_images():
    g = torch.Generator().manual_seed(0)
    crop = ResizedCrop(32)
    dec = DeviceDecoder(crop, "cpu", batched=True)  # the GPU's crop stage (a CPU crops image by image)
    counts = {}
    for n in (64, 256):
        sizes = torch.randint(33, 60, (n, 2), generator=g).tolist()
        images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g) for h, w in sizes]
        boxes = torch.tensor([[0, 0, h, w] for h, w in sizes])
        out = torch.empty((n, 3, 32, 32))
        slots = torch.arange(n)
        counts[n] = _count_ops(functools.partial(dec.crop_stage, out, images, boxes, slots))
        assert out.min() >= 0 and out.max() <= 255 and out.std() > 10  # every slot written
    # ~160 calls, 40 % of them views (no kernel): the per-image path made ~6 kernels and ~10 calls per image
    assert counts[64] == counts[256] < 200, counts


def test_a_device_decoder_that_does_not_work_stops_the_run_in_one_line(tmp_path, monkeypatch):
    """torchvision without nvJPEG (or nvJPEG failing to start) raises on every decode: the host would
    decode every image behind a "device" label. The first batch says so and stops, naming the fix."""
    import torchvision.io

    def no_nvjpeg(data, **kw):
        raise RuntimeError("decode_jpegs_cuda: torchvision not compiled with nvJPEG support")

    monkeypatch.setattr(torchvision.io, "decode_jpeg", no_nvjpeg)
    write_shards(make_jpegs(16, seed=2, short_side=(40, 60)), tmp_path / "data", per_shard=16)
    r = train(tmp_path / "data", tmp_path / "run", *TEACHER, "train.steps=2", "data.batch_size=8", "data.decode=device")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("error: data.decode=device: 7 of the first batch's 7 device-taken JPEGs") and \
        "not compiled with nvJPEG" in line and "data.decode=worker" in line, line


def _tf32(t: torch.Tensor) -> torch.Tensor:
    """``t`` (float32) as a TF32 tensor core reads it: the mantissa rounded to its top 10 bits (nearest)."""
    i = t.contiguous().view(torch.int32)
    return ((i + 0x1000) & -8192).view(torch.float32)


def test_the_crop_stage_gives_the_same_pixels_under_tf32(monkeypatch):
    """On a GPU the trainer turns TF32 on, and TF32 products keep 10 bits of each weight: the crop stage
    splits its weights so that the pixels do not move. Emulated here by rounding every matmul operand
    to TF32: the batched crop equals the fp32 one, while a plain product under TF32 moves pixels."""
    import io

    import numpy as np
    from PIL import Image

    from mmpretrain.data import resample

    images = [torch.from_numpy(np.asarray(Image.open(io.BytesIO(j)).convert("RGB"))).permute(2, 0, 1)
              for _, j in make_jpegs(8, seed=3)]
    padded = resample.pad(images)
    boxes = torch.tensor([[3, 5, im.shape[1] - 10, im.shape[2] - 7] for im in images])
    exact = resample.crop_resize(padded, boxes, (224, 224), Image.BICUBIC)

    matmul = torch.matmul
    monkeypatch.setattr(torch, "matmul", lambda a, b: matmul(_tf32(a), _tf32(b)))
    split = (resample.crop_resize(padded, boxes, (224, 224), Image.BICUBIC) - exact).abs()
    # without the split the same emulation moves pixels (the emulation is not a no-op)
    monkeypatch.setattr(resample, "_exact_matmul", lambda a, b, weights_right: torch.matmul(a, b))
    plain = (resample.crop_resize(padded, boxes, (224, 224), Image.BICUBIC) - exact).abs()
    # measured: 14 of 1,204,224 values a grey level off (fp32 in another summation order: 13), against
    # 24,639 up to 2 levels off from a plain product under TF32
    assert split.max() <= 1 and (split > 0).sum() <= 50
    assert plain.max() >= 2 and (plain > 0).sum() >= 10_000
