"""data.decode=device (mmpretrain.data.device_decode): the workers hand over JPEG bytes and the crop box,
the trainer decodes, crops and resizes them (here with the device set to the CPU). The boxes are the
worker path's, the pixels within a stated tolerance of it, what the device cannot take stays with the
workers, a bad JPEG in a batch is a counted skip, and training resumes bit for bit."""

from __future__ import annotations

import io
import json
import shutil

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from mmpretrain.data.batch import collate
from mmpretrain.data.crop import ResizedCrop
from mmpretrain.data.decode import SampleDecoder, augmentation_seed
from mmpretrain.data.device_decode import DeviceDecoder
from mmpretrain.data.jpeg import device_jpeg
from mmpretrain.testing.photos import bad_huffman, make_jpegs

from conftest import TEXT_MODEL, run_main, setup_run, train


def _jpeg(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", **kw)
    return buf.getvalue()


def _raws(jpegs):
    return [{"__key__": f"{i:04d}", "jpg": b, "txt": c.encode()} for i, (c, b) in enumerate(jpegs)]


def _batch(decoder, raws, seed=0, epoch=0):
    return collate([dict(decoder(r, seed, epoch), index=i) for i, r in enumerate(raws)])


def test_the_header_check_sends_only_what_the_device_decodes():
    cap, jpg = make_jpegs(1, short_side=(96, 120))[0]
    img = Image.open(io.BytesIO(jpg))
    assert device_jpeg(jpg) == img.size
    # progressive: torchvision Huffman-decodes it on the host, one at a time; the workers keep it
    assert device_jpeg(_jpeg(img, progressive=True)) is None
    assert device_jpeg(_jpeg(img, progressive=True), progressive=True) == img.size
    assert device_jpeg(_jpeg(img.convert("L"))) == img.size
    png = io.BytesIO()
    img.save(png, "PNG")
    sof = jpg.index(b"\xff\xc0")
    for what, data in {"CMYK": _jpeg(img.convert("CMYK")), "truncated": jpg[:len(jpg) // 2], "PNG": png.getvalue(),
                       "arithmetic": jpg[:sof + 1] + b"\xc9" + jpg[sof + 2:], "empty": b"",
                       # an Adobe APP14 marker saying "no transform": the three components are RGB
                       "Adobe RGB": jpg[:2] + b"\xff\xee\x00\x0eAdobe\x00\x64\x00\x00\x00\x00\x00" + jpg[2:]}.items():
        assert device_jpeg(data) is None, what
    # the same with transform 1 (YCbCr): taken
    ycc = jpg[:2] + b"\xff\xee\x00\x0eAdobe\x00\x64\x00\x00\x00\x00\x01" + jpg[2:]
    assert device_jpeg(ycc) == img.size

    # the worker decodes what the device path does not take; a batch mixes both
    crop = ResizedCrop(64)
    raws = _raws([(cap, jpg), (cap, _jpeg(img.convert("CMYK"))), (cap, png.getvalue())])
    raws[2]["png"] = raws[2].pop("jpg")
    batch = _batch(SampleDecoder(crop, embeddings="ignore", device_decode=True), raws)
    assert batch.jpeg.slots.tolist() == [0] and batch.jpeg.image_slots.tolist() == [1, 2]
    # no placeholder pixels: only the worker-decoded images travel
    assert batch.images.shape == (2, 64, 64, 3) and batch.images.ne(0).any()
    # a JPEG whose box the worker decodes at a DCT reduction stays with the worker
    big = _raws(make_jpegs(1, seed=3))
    batch = _batch(SampleDecoder(ResizedCrop(64, scale=(0.9, 1.0)), embeddings="ignore", device_decode=True), big)
    assert batch.jpeg is None and batch.images.shape == (1, 64, 64, 3)


def test_boxes_equal_and_pixels_within_tolerance_of_the_worker_path():
    jpegs = make_jpegs(24)  # photos, shorter side 256-512 px, as the trainer crops them to 224
    raws = _raws(jpegs)
    crop = ResizedCrop(224, scale=(0.08, 1.0))
    worker = _batch(SampleDecoder(crop, embeddings="ignore"), raws)
    device = _batch(SampleDecoder(crop, embeddings="ignore", device_decode=True), raws)
    # the same boxes, in original pixels, as the worker draws from the same seed; the device takes those
    # the worker would decode at full size
    boxes = [crop.box(Image.open(io.BytesIO(r["jpg"])), augmentation_seed(0, 0, r["__key__"])) for r in raws]
    taken = [i for i, b in enumerate(boxes) if crop.jpeg_reduction(b) == 1]
    assert 12 <= len(taken) < 24 and device.jpeg.slots.tolist() == taken
    assert [tuple(b) for b in device.jpeg.boxes.tolist()] == [tuple(boxes[i]) for i in taken]
    assert device.jpeg.image_slots.tolist() == [i for i in range(24) if i not in taken]
    assert device.keys == worker.keys and device.texts == worker.texts
    DeviceDecoder(crop, "cpu", batched=True)(device)  # the GPU's crop stage; no normalisation: pixel values
    assert device.jpeg is None and device.images.shape == (24, 3, 224, 224)
    assert device.skipped == {"device_decoded": len(taken)}
    diff = (device.images - worker.images.permute(0, 3, 1, 2).float()).abs()
    assert diff[[i for i in range(24) if i not in taken]].max() == 0  # the workers' own, placed
    # torchvision's decoder + Pillow's bicubic weights in float matrix products (mmpretrain/data/resample.py)
    # against Pillow's libjpeg decode and fixed-point resize: measured mean 0.05, max 5 grey levels here
    diff = diff[taken]
    assert diff.mean() < 0.25 and diff.max() <= 8, (diff.mean(), diff.max())

    # normalised, channels_last: DeviceNormalize's arithmetic on the same pixels
    from mmpretrain.data.decode import DeviceNormalize

    norm = DeviceNormalize((0.48, 0.46, 0.41), (0.27, 0.26, 0.28), channels_last=True)
    again = _batch(SampleDecoder(crop, embeddings="ignore", device_decode=True), raws)
    DeviceDecoder(crop, "cpu", normalize=norm, channels_last=True, batched=True)(again)
    assert again.images.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(again.images, norm(device.images.permute(0, 2, 3, 1).to(torch.uint8)),
                               rtol=0, atol=1e-6)

    # a CPU device crops image by image with torchvision's native kernel (the earlier kernel; the same
    # boxes): measured mean 0.16, max 11 grey levels from the worker's
    each = _batch(SampleDecoder(crop, embeddings="ignore", device_decode=True), raws)
    DeviceDecoder(crop, "cpu")(each)
    diff = (each.images - worker.images.permute(0, 3, 1, 2).float()).abs()[taken]
    assert diff.mean() < 0.5 and diff.max() <= 16, (diff.mean(), diff.max())


def test_a_bad_jpeg_is_a_counted_skip_and_a_refused_one_decodes_on_the_host(monkeypatch):
    jpegs = make_jpegs(6, seed=1, short_side=(96, 120))
    raws = _raws(jpegs)
    raws[2]["jpg"] = bad_huffman(raws[2]["jpg"])
    crop = ResizedCrop(64)
    dec = SampleDecoder(crop, embeddings="ignore", device_decode=True)
    batch = _batch(dec, raws)
    assert batch.jpeg.slots.tolist() == list(range(6))  # the header passes
    DeviceDecoder(crop, "cpu", chunk=4)(batch)
    assert batch.skipped == {"undecodable_image": 1, "repeated_in_batch": 1, "device_decoded": 5}
    # the slot repeats the batch's first good sample, every field
    assert batch.keys[2] == batch.keys[0] and torch.equal(batch.images[2], batch.images[0])
    assert batch.sample_index.tolist() == [0, 1, 0, 3, 4, 5]

    # a device that refuses one image (and so every batch holding it): decoded by the worker's code
    import torchvision.io

    real = torchvision.io.decode_jpeg
    refused = bytes(raws[4]["jpg"])

    def picky(data, **kw):
        blobs = data if isinstance(data, list) else [data]
        if any(b.numpy().tobytes() == refused for b in blobs):
            raise RuntimeError("nvjpeg: unsupported")
        return real(data, **kw)

    monkeypatch.setattr(torchvision.io, "decode_jpeg", picky)
    raws[2]["jpg"] = jpegs[2][1]
    batch = _batch(dec, raws)
    calls = []
    monkeypatch.setattr(torchvision.io, "decode_jpeg", lambda data, **kw: calls.append(len(data)) or picky(data, **kw))
    DeviceDecoder(crop, "cpu")(batch)
    assert batch.skipped == {"device_decode_fallback": 1, "device_decoded": 5}
    # the chunk is bisected to the culprit (6 -> 3 + 3 -> 1 + 2 -> ...), not decoded one by one
    assert calls == [6, 3, 3, 1, 2, 1, 1], calls
    worker = _batch(SampleDecoder(crop, embeddings="ignore"), raws)
    assert torch.equal(batch.images[4], worker.images[4].permute(2, 0, 1).float())  # the worker path's own


@pytest.fixture(scope="module")
def openmoji_jpg(tmp_path_factory):
    """The demo's OpenMoji data as 64-px JPEGs (the device path's input), built and embedded."""
    out = tmp_path_factory.mktemp("data") / "openmoji_jpg"
    r = run_main("data_tools", "build", "demo:openmoji", "--out", str(out), "--image-size", "64",
                 "--shard-size", "50", "--limit", "500", "--image-format", "jpg")
    assert r.returncode == 0, r.stderr
    r = run_main("data_tools", "embed", str(out), "--model", TEXT_MODEL)
    assert r.returncode == 0, r.stderr
    return out


RUN = ["train.steps=6", "data.batch_size=16", "data.num_workers=2", "data.shuffle_buffer=32", "train.log_every=1",
       "train.save_every=3", "train.keep_last=2", "data.decode=device"]


def test_the_demo_trains_with_device_decoding_and_resumes_exactly(openmoji_jpg, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(openmoji_jpg, data)
    # one JPEG whose header passes and whose pixels nothing can decode, patched in place (same length,
    # so the sidecar's record of the shard still holds)
    shard = sorted((data / "train").glob("*.tar"))[0]
    blob = shard.read_bytes()
    start = blob.index(b"\xff\xd8\xff")
    end = blob.index(b"\xff\xd9", start) + 2
    shard.write_bytes(blob[:start] + bad_huffman(blob[start:end]) + blob[end:])

    a = tmp_path / "a"
    r = train(data / "train", a, *RUN)
    assert r.returncode == 0, r.stderr[-3000:]
    state = json.loads((a / "checkpoints/step_00000006/train_state.json").read_text())
    skipped = state["skipped"]
    assert skipped.get("undecodable_image") == 1 and skipped.get("repeated_in_batch") == 1, skipped

    b = tmp_path / "b"  # killed after step 5, before the final checkpoint: resumes from step 3
    shutil.copytree(a, b)
    shutil.rmtree(b / "checkpoints/step_00000006")
    (b / "log.jsonl").write_text("".join((a / "log.jsonl").read_text().splitlines(keepends=True)[:5]))
    r = train(data / "train", b, *RUN)
    assert r.returncode == 0 and "resumed from" in r.stderr, r.stderr[-3000:]
    wa = load_file(a / "checkpoints/step_00000006/model.safetensors")
    wb = load_file(b / "checkpoints/step_00000006/model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)

    # the worker path on the same data: the same samples (the bad one skipped there before batching)
    c = tmp_path / "c"
    r = train(data / "train", c, *RUN[:-1], "data.decode=worker")
    assert r.returncode == 0, r.stderr[-3000:]
    sc = json.loads((c / "checkpoints/step_00000006/train_state.json").read_text())["skipped"]
    assert sc.get("undecodable_image") == 1 and "repeated_in_batch" not in sc


def test_device_decoding_refuses_an_augmentation_only_workers_run(openmoji_jpg, tmp_path):
    r = train(openmoji_jpg / "train", tmp_path / "run", "train.steps=2", "data.decode=device",
              "data.aug_cfg={color_jitter: [0.4, 0.4, 0.4, 0.1], color_jitter_prob: 0.8}")
    assert r.returncode == 2 and "data.decode=device" in r.stderr and "data.decode=worker" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_device_decoding_replays_the_teachers_stored_crops(openmoji_jpg, demo_run, tmp_path):
    """data.decode=device with distill: the boxes handed to the device are the stored crops of the
    epoch, the rows those crops' rows (the worker path's: tests/test_teacher.py)."""
    import random

    import numpy as np

    from mmpretrain.data.teacher import CROPS, TEACHERS, teacher_files

    data = tmp_path / "data"
    shutil.copytree(openmoji_jpg / "train", data)
    r = run_main("data_tools", "embed", str(data), "--image-model", str(demo_run), "--augmentations", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    run = setup_run(data, tmp_path / "run", "train.steps=2", "data.batch_size=16", "data.num_workers=0",
                    "data.decode=device", "loss=[{name: clip}, {name: distill}]")
    batch = next(iter(run.loader))
    index = json.loads((data / TEACHERS).read_text())
    (tid, block), = index["teachers"].items()
    names = sorted(block["shards"])
    offsets = np.cumsum([0] + [block["shards"][n]["count"] for n in names])
    # slot 0: the batch's anchor, decoded by the worker, as is a stored crop the worker would decode reduced
    assert set(batch.jpeg.slots.tolist()) <= set(range(1, 16)) and len(batch.jpeg.slots) >= 8
    for slot, box in zip(batch.jpeg.slots.tolist(), batch.jpeg.boxes.tolist()):
        idx = int(batch.sample_index[slot])
        k = int(np.searchsorted(offsets, idx, side="right") - 1)
        a = 1 + random.Random(f"0:0:{idx}:teacher-crop").randrange(2)
        assert box == np.load(data / (names[k] + CROPS))[idx - offsets[k], a].tolist()
        row = np.load(data / (names[k] + teacher_files(tid)[0]))[idx - offsets[k], a]
        np.testing.assert_array_equal(batch.teacher_image_embeddings[slot].numpy(), row.astype(np.float32))
    run.images.decoder(batch)
    assert batch.images.float().std() > 0  # decoded in place


def test_a_shard_where_no_image_decodes_trains_on_the_device_path(tmp_path):
    """Every JPEG of one shard passes the header check and decodes nowhere: each is a counted skip (its
    slot repeats the batch's first image, which the worker decodes), never "no image of the batch could
    be decoded" (it raised RuntimeError)."""
    from mmpretrain.testing.photos import write_shards

    from conftest import TEACHER

    photos = make_jpegs(32, seed=7, short_side=(40, 60))  # under 2 x 32 px: every one goes to the device
    photos[:16] = [(c, bad_huffman(j)) for c, j in photos[:16]]
    write_shards(photos, tmp_path / "data", per_shard=16)
    # unshuffled: two whole batches of the bad shard
    r = train(tmp_path / "data", tmp_path / "run", *TEACHER, "train.epochs=1", "train.steps=null", "data.batch_size=8",
              "train.log_every=1", "data.decode=device", "data.shuffle_buffer=0")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    last = json.loads((tmp_path / "run" / "log.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 4 and last["skipped"]["undecodable_image"] == 16, last
    # every good image but the 4 batches' anchors decoded on the device; the workers, looking for an anchor,
    # met the bad shard's JPEGs first (unshuffled) and skipped them
    assert last["skipped"]["device_decoded"] == 32 - 4, last


def test_a_step_sends_the_device_only_contiguous_host_tensors_from_pinned_memory(openmoji_jpg, tmp_path, monkeypatch):
    """Every host tensor a non-logging step sends to the device (batch, trimmed tokens, the device
    decoder's boxes and slots, the patch-dropout mask) is recorded: each is contiguous (a copy from a
    view goes through pageable memory, which on CUDA makes the stream wait for the host), and the
    loader is asked to pin its batches where the device is CUDA (on a CPU nothing can be pinned)."""
    import mmpretrain.train.run_setup as run_setup
    from mmpretrain.testing.copies import CopyAudit
    from mmpretrain.train import train_step
    from mmpretrain.train.inputs import pins

    assert pins(torch.device("cuda")) and not pins(torch.device("cpu"))
    monkeypatch.setattr(run_setup, "pins", lambda device: True)  # as on CUDA: the request reaches the loader
    run = setup_run(openmoji_jpg / "train", tmp_path / "run", "data.decode=device", "model.patch_dropout=0.5",
                    "data.num_workers=0", "train.log_every=100", "data.batch_size=16", "train.steps=5",
                    "model.lock_text=false", "model.text_from_targets=false", "model.arch=mmpt-tiny-vit")
    assert run.task.trim_text
    assert run.loader.pin_memory
    batch = next(iter(run.loader))
    assert batch.jpeg is not None and int(batch.tokens.ne(0).sum(1).max()) < batch.tokens.shape[1]  # trims
    with CopyAudit() as audit:
        train_step(run, batch)
    sent = {c.caller.rsplit("/", 1)[1].split(":")[0] for c in audit.copies}
    assert {"task.py", "image_input.py", "device_decode.py"} <= sent, audit.copies
    assert all(c.contiguous for c in audit.copies), [c for c in audit.copies if not c.contiguous]


def test_the_decoding_thread_never_swaps_the_warning_filters(monkeypatch):
    """The device decoder runs on a background thread (Prefetcher); warnings.catch_warnings there would
    swap the process-wide filters and showwarning under the training thread, whose host-sync count
    (the GPU check's) reads them. Its filters are set once, at import: a decode calls it not once."""
    import warnings

    raws = _raws(make_jpegs(8))
    crop = ResizedCrop(224, scale=(0.08, 1.0))
    batch = _batch(SampleDecoder(crop, embeddings="ignore", device_decode=True), raws)  # the workers' part
    calls = []

    class Counted(warnings.catch_warnings):
        def __init__(self, *a, **kw):
            calls.append(1)
            super().__init__(*a, **kw)

    monkeypatch.setattr(warnings, "catch_warnings", Counted)
    DeviceDecoder(crop, "cpu", batched=True)(batch)
    assert batch.images.shape == (8, 3, 224, 224) and calls == []


def test_the_nvjpeg_probe_reads_the_library_torchvision_loaded(tmp_path):
    """A CUDA 13 image maps libnvjpeg.so.13 (torchvision's or the nvidia wheel's), not .so.12: the probe
    takes the path the process has mapped, whatever its soname."""
    from mmpretrain.data.device_decode import loaded_library

    maps = tmp_path / "maps"
    lib = "/usr/lib/python3/site-packages/nvidia/nvjpeg/lib/libnvjpeg.so.13"
    maps.write_text(f"7f00-7f10 r--p 00000000 00:2a 123  /usr/lib/libc.so.6\n"
                    f"7f10-7f20 r-xp 00001000 00:2a 456  {lib}\n7f20-7f30 rw-p 00000000 00:00 0 \n")
    assert loaded_library("libnvjpeg", str(maps)) == lib
    assert loaded_library("libnvjpeg", str(tmp_path / "none")) is None
    assert loaded_library("libtorch_cpu").endswith("libtorch_cpu.so")  # this process, for real
