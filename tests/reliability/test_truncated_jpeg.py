"""A JPEG whose data do not cover the frame its header declares -- cut short but still ending in EOI, or a
header claiming 8000 x 8000 around a small picture -- is a counted ``truncated_jpeg`` skip on both decode
paths, by mmpretrain/data/jpeg.py's rule (Pillow and torchvision's CPU decoder turn both into grey pixels
without an error); whole photos, baseline or progressive, are kept."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from mmpretrain.data.batch import collate
from mmpretrain.data.crop import ResizedCrop
from mmpretrain.data.decode import SampleDecoder, SkipSample
from mmpretrain.data.device_decode import DeviceDecoder
from mmpretrain.data.jpeg import device_jpeg
from mmpretrain.testing.photos import cut_short, lying, make_jpegs


def _jpeg(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=90, **kw)
    return buf.getvalue()


def _raw(i: int, jpg: bytes) -> dict:
    return {"__key__": f"k{i}", "jpg": jpg, "txt": b"a photo"}


def _decoders(crop):
    from open_clip.transform import PreprocessCfg, image_transform_v2

    torchvision_transform = image_transform_v2(PreprocessCfg(size=64), is_train=True)
    return {"worker": SampleDecoder(crop, embeddings="ignore"),  # one pass, DCT-reduced decode
            "transform": SampleDecoder(torchvision_transform, embeddings="ignore", draft_size=128),
            "device": SampleDecoder(crop, embeddings="ignore", device_decode=True)}


def _verdict(decoder, crop, jpg):
    """``"kept"`` or the skip reason of one image through ``decoder`` (and the device, for what it ships)."""
    raws = [_raw(0, make_jpegs(1, seed=9)[0][1]), _raw(1, jpg)]  # slot 0: the batch's anchor
    try:
        items = [dict(decoder(r, 0, 0, anchor=(i == 0)), index=i) for i, r in enumerate(raws)]
    except SkipSample as e:
        return e.reason
    batch = collate(items)
    if batch.jpeg is not None:
        assert batch.jpeg.slots.tolist() == [1]
        DeviceDecoder(crop, "cpu", batched=True)(batch)  # the GPU's crop stage and tail check
        bad = {k: v for k, v in batch.skipped.items() if k not in ("repeated_in_batch", "device_decoded")}
        return next(iter(bad), "kept")
    return "kept"


@pytest.mark.parametrize("out", [64, 224])  # 64: decoded at a DCT reduction of 2-8; 224: at full size
def test_cut_and_lying_jpegs_are_truncated_skips_on_both_paths_and_photos_are_kept(out):
    crop = ResizedCrop(out, scale=(0.9, 1.0))
    photo = make_jpegs(3, seed=4)
    progressive = _jpeg(Image.open(io.BytesIO(photo[1][1])), progressive=True)
    grey = _jpeg(Image.open(io.BytesIO(photo[2][1])).convert("L"))
    cases = {"photo": (photo[0][1], "kept"), "progressive": (progressive, "kept"), "grey": (grey, "kept"),
             # a progressive file cut in its later scans: its first scan covers the frame, a blurrier whole
             "progressive, later scans cut": (cut_short(progressive, 0.7), "kept"),
             "cut, ends in EOI": (cut_short(photo[0][1]), "truncated_jpeg"),
             "progressive, first scan cut": (cut_short(progressive, 0.03), "truncated_jpeg"),
             "grey, cut": (cut_short(grey), "truncated_jpeg"),
             "8000 x 8000 header": (lying(photo[0][1]), "truncated_jpeg"),
             "progressive, 8000 x 8000": (lying(progressive), "truncated_jpeg"),
             # a mild lie: twice the size, the bytes could hold it, the data run out (rule 2)
             "twice its size": (lying(photo[0][1], 2 * max(Image.open(io.BytesIO(photo[0][1])).size)), "truncated_jpeg")}
    for name, decoder in _decoders(crop).items():
        got = {case: _verdict(decoder, crop, jpg) for case, (jpg, _) in cases.items()}
        assert got == {case: want for case, (_, want) in cases.items()}, (name, got)


def test_the_device_path_ships_a_cut_file_and_refuses_a_lying_one():
    """The header check sends a cut JPEG that ends in EOI to the device (it cannot tell), where rule 2
    finds it; a frame the bytes cannot hold stays with the worker, which skips it (rule 1)."""
    jpg = make_jpegs(1, seed=5)[0][1]
    assert device_jpeg(cut_short(jpg)) == Image.open(io.BytesIO(jpg)).size
    assert device_jpeg(lying(jpg)) is None


@pytest.mark.parametrize("decode", ["worker", "device"])
def test_an_epoch_through_the_cli_counts_them(tmp_path, decode):
    """40 photos in 2 shards, one cut short (ending in EOI) and one with an 8000 x 8000 header: one epoch
    trains on both paths, each bad one counted once as truncated_jpeg, no traceback."""
    import json

    from mmpretrain.testing.photos import write_shards

    from conftest import TEACHER, train

    # smaller than twice the model's 32 px: the device path takes every baseline JPEG (no DCT reduction)
    photos = make_jpegs(40, seed=6, short_side=(40, 60))
    photos[7] = (photos[7][0], cut_short(photos[7][1]))
    photos[29] = (photos[29][0], lying(photos[29][1]))
    write_shards(photos, tmp_path / "data", per_shard=20)
    r = train(tmp_path / "data", tmp_path / "run", *TEACHER, "train.epochs=1", "train.steps=null", "data.batch_size=8",
              "train.log_every=1", "data.shuffle_buffer=0", f"data.decode={decode}")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    last = json.loads((tmp_path / "run" / "log.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 5 and last["skipped"]["truncated_jpeg"] == 2, last
    # the device path met the cut one on the device (its slot repeats another sample; unshuffled, it is not
    # the first of its batch, which the worker decodes), the lying one not
    assert last["skipped"].get("repeated_in_batch", 0) == (1 if decode == "device" else 0), last
