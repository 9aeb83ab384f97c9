"""Teacher targets beside the shards (data_tools embed --image-model) and training on them (distill):
the rows are the teacher's embeddings of the stored crops, the stream replays the crop it hands the
rows of, a resume is bit-identical, tampered files are counted skips, mistakes are refused."""

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from mmpretrain.data.crop import CropSampler
from mmpretrain.data.decode import augmentation_seed
from mmpretrain.data.teacher import CROPS, TEACHERS, teacher_files

from conftest import run_main, setup_run, train

K = 3  # the teacher_data fixture's crops (conftest.py)
DISTILL = ["model.arch=mmpt-tiny-vit", "model.lock_text=false", "model.text_from_targets=false",
           "data.batch_size=16", "data.num_workers=0", "data.shuffle_buffer=32",
           "loss=[{name: clip, weight: 0.5}, {name: distill, weight: 1.0}]"]


def _index(data: Path) -> tuple[str, dict]:
    index = json.loads((data / TEACHERS).read_text())
    (tid, block), = index["teachers"].items()
    return tid, index


def test_embed_writes_the_teachers_rows_of_the_stored_crops(teacher_data):
    from mmpretrain.models.from_disk import load_model

    data = teacher_data["data"]
    tid, index = _index(data)
    total = sum(json.loads((data / "sizes.json").read_text()).values())
    assert index["augmentations"]["count"] == K and teacher_data["out"]["teachers"][0]["images"] == total
    block = index["teachers"][tid]
    name = sorted(block["shards"])[0]
    crops = np.load(data / (name + CROPS))
    image, text, _ = (np.load(data / (name + s)) for s in teacher_files(tid))
    n, e = block["shards"][name]["count"], block["dim"]
    assert crops.shape == (n, 1 + K, 4) and image.shape == (n, 1 + K, e) and text.shape == (n, e)
    assert image.dtype == np.float16 and np.allclose(np.linalg.norm(image.astype(np.float32), axis=-1), 1, atol=2e-3)
    keys = (data / (name + ".teacher_keys.txt")).read_text().splitlines()
    # the crops are the training sampler's, seeded by (seed, key); row 0 is the image's size
    from mmpretrain.data.tar import read_tar

    raw = next(iter(read_tar(str(data / name))))
    import io

    from PIL import Image

    img = Image.open(io.BytesIO(raw["png"])).convert("RGB")
    assert keys[0] == raw["__key__"] and tuple(crops[0, 0]) == (0, 0, img.height, img.width)
    rng = random.Random(augmentation_seed(0, 0, raw["__key__"] + "/teacher-crops"))
    sampler = CropSampler(index["augmentations"]["scale"], index["augmentations"]["ratio"])
    assert [tuple(c) for c in crops[0, 1:]] == [tuple(sampler(img.width, img.height, rng)) for _ in range(K)]
    # each row is the teacher's own embedding of that view and of caption 0
    model, preprocess, tokenizer = load_model(str(teacher_data["teacher"]))
    from data_tools.embed_teacher import Teacher

    t = Teacher(str(teacher_data["teacher"]), None, "cpu")
    want = t.image(t.views(img, [tuple(c) for c in crops[0, 1:]])).numpy()
    assert np.abs(image[0].astype(np.float32) - want).max() < 2e-3
    with torch.no_grad():
        y = torch.nn.functional.normalize(model.encode_text(tokenizer([raw["txt"].decode()])), dim=-1)[0].numpy()
    assert np.abs(text[0].astype(np.float32) - y).max() < 2e-3
    r = run_main("data_tools", "verify", str(data), "--strict")
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


def test_embed_resumes_adds_a_second_teacher_and_refuses_other_crops(teacher_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(teacher_data["data"], data)
    first, _ = _index(data)
    again = run_main("data_tools", "embed", str(data), "--image-model", str(teacher_data["teacher"]),
                     "--augmentations", str(K))
    assert again.returncode == 0 and json.loads(again.stdout)["teachers"][0]["shards"] == 0  # all done: skipped
    copy = tmp_path / "teacher_copy"
    shutil.copytree(teacher_data["teacher"], copy)  # the same weights under another path: refused, nothing written
    before = {p.name: p.read_bytes() for p in data.iterdir() if p.is_file()}
    r = run_main("data_tools", "embed", str(data), "--image-model", str(copy), "--augmentations", str(K))
    assert r.returncode == 2 and "already holds this teacher" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert {p.name: p.read_bytes() for p in data.iterdir() if p.is_file()} == before
    other = tmp_path / "teacher2"  # an ensemble's second member: other weights
    shutil.copytree(teacher_data["teacher"], other)
    for ckpt in other.glob("checkpoints/*/model.safetensors"):
        from safetensors.torch import load_file, save_file

        weights = load_file(ckpt)
        save_file({k: v * 1.01 if v.is_floating_point() else v for k, v in weights.items()}, str(ckpt))
    crops_before = np.load(data / (sorted(_index(data)[1]["teachers"][first]["shards"])[0] + CROPS))
    r = run_main("data_tools", "embed", str(data), "--image-model", str(other), "--augmentations", str(K))
    assert r.returncode == 0, r.stderr[-2000:]
    index = json.loads((data / TEACHERS).read_text())
    assert len(index["teachers"]) == 2 and first in index["teachers"]  # no --overwrite needed, the first kept
    name = sorted(index["teachers"][first]["shards"])[0]
    assert np.array_equal(np.load(data / (name + CROPS)), crops_before)  # the members share the crops
    default = run_main("data_tools", "embed", str(data), "--image-model", str(other))  # K: the recorded one
    assert default.returncode == 0 and json.loads(default.stdout)["teachers"][0]["augmentations"] == K
    bad = run_main("data_tools", "embed", str(data), "--image-model", str(other), "--augmentations", "5")
    assert bad.returncode == 2 and "--overwrite" in bad.stderr and "K=3" in bad.stderr
    for args, words in ((["--image-model", str(tmp_path / "nope")], "--image-model"),
                        ([], "--image-model"), (["--image-model", str(other), "--augmentations", "-1"], "-1"),
                        (["--image-model", "ViT-B-32"], "--pretrained"),
                        (["--image-model", str(other), "--pretrained", "openai"], "--pretrained")):
        r = run_main("data_tools", "embed", str(data), *args)
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_embed_into_an_out_folder_keeps_the_users_files(teacher_data, tmp_path):
    """--out into a folder that holds a user's file: it stays; a teachers.json embed did not write is
    refused and left as it is."""
    out = tmp_path / "emb"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    r = run_main("data_tools", "embed", str(teacher_data["data"]), "--image-model", str(teacher_data["teacher"]),
                 "--augmentations", "1", "--out", str(out))
    assert r.returncode == 0 and (out / "notes.txt").read_text() == "mine" and (out / TEACHERS).is_file()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / TEACHERS).write_text('{"someone": "else"}')
    r = run_main("data_tools", "embed", str(teacher_data["data"]), "--image-model", str(teacher_data["teacher"]),
                 "--out", str(foreign))
    assert r.returncode == 2 and "not an index embed wrote" in r.stderr
    assert (foreign / TEACHERS).read_text() == '{"someone": "else"}' and sorted(p.name for p in foreign.iterdir()) == [
        TEACHERS]


def _batch_rows(data: Path, batch: dict, seed: int = 0, epoch: int = 0):
    """The stored rows and crop a batch's samples should carry: per sample, the crop drawn by (seed,
    epoch, sample index) among the K stored ones."""
    tid, index = _index(data)
    shards = sorted(index["teachers"][tid]["shards"])
    sizes = [index["teachers"][tid]["shards"][s]["count"] for s in shards]
    offsets = np.cumsum([0] + sizes)
    rows = []
    for idx in batch.sample_index.tolist():
        k = int(np.searchsorted(offsets, idx, side="right") - 1)
        pos = idx - offsets[k]
        a = 1 + random.Random(f"{seed}:{epoch}:{idx}:teacher-crop").randrange(K)
        image = np.load(data / (shards[k] + teacher_files(tid)[0]))[pos, a]
        crops = np.load(data / (shards[k] + CROPS))[pos]
        rows.append((shards[k], pos, a, image, crops))
    return rows


def test_stream_replays_the_stored_crop_it_hands_the_rows_of(teacher_data, tmp_path):
    import io

    from PIL import Image

    from mmpretrain.data.crop import Box
    from mmpretrain.data.tar import read_tar

    data = teacher_data["data"]
    run = setup_run(data, tmp_path / "run", "train.steps=2", *DISTILL)
    batch = next(iter(run.loader))
    assert run.task.teacher_dims == [_index(data)[1]["teachers"][_index(data)[0]]["dim"]]
    expected = _batch_rows(data, batch)
    got = batch.teacher_image_embeddings.numpy()
    for j, (shard, pos, a, image, crops) in enumerate(expected[:6]):
        np.testing.assert_array_equal(got[j], image.astype(np.float32))
        raw = list(read_tar(str(data / shard)))[pos]
        img = Image.open(io.BytesIO(raw["png"]))
        want = run.loader.dataset.decoder.transform.apply(img, Box(*map(int, crops[a])))
        assert torch.equal(batch.images[j], want)  # exactly the stored crop, not a fresh one


def test_distill_trains_and_resumes_bit_identically(teacher_data, tmp_path):
    from safetensors.torch import load_file

    data = teacher_data["data"]
    run_dir = tmp_path / "run"
    args = ["train.steps=4", "train.save_every=2", "train.keep_last=5", "train.log_every=1", *DISTILL]
    r = train(data, run_dir, *args)
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines()]
    assert all(np.isfinite(x["distill_unweighted"]) for x in records if "distill_unweighted" in x)
    final = run_dir / "checkpoints/step_00000004"
    ref = load_file(next(final.glob("**/model.safetensors")))
    shutil.rmtree(final)
    r = train(data, run_dir, *args)
    assert r.returncode == 0 and "resumed" in r.stderr, r.stderr[-3000:]
    got = load_file(next((run_dir / "checkpoints/step_00000004").glob("**/model.safetensors")))
    assert all(torch.equal(ref[k], got[k]) for k in ref)


def test_tampered_teacher_files_are_counted_skips(teacher_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(teacher_data["data"], data)
    tid, index = _index(data)
    names = sorted(index["teachers"][tid]["shards"])
    # shard 0: rows of another shape; shard 1: every crop drawn for an image of another size
    image = np.load(data / (names[0] + teacher_files(tid)[0]))
    np.save(data / (names[0] + teacher_files(tid)[0]), image[:, :2])
    crops = np.load(data / (names[1] + CROPS))
    crops[:, 0, 2] += 1
    np.save(data / (names[1] + CROPS), crops)
    r = train(data, tmp_path / "run", "train.steps=26", "train.log_every=26", *DISTILL[:-1],  # one epoch
              "data.mode=epoch", "loss=[{name: distill}]")
    assert r.returncode == 0, r.stderr[-3000:]
    skipped = json.loads((tmp_path / "run/log.jsonl").read_text().splitlines()[-1])["skipped"]
    # every position of the epoch read once: 50 each, less those among the 5 spares the readers did not need
    assert 45 <= skipped.get("missing_teacher", 0) <= 50 and 45 <= skipped.get("teacher_crop_mismatch", 0) <= 50, \
        skipped
    v = run_main("data_tools", "verify", str(data))
    assert "bad_teacher_file" in v.stdout, v.stdout


def test_distill_without_teacher_rows_or_with_other_augmentations_is_refused(openmoji, teacher_data, tmp_path):
    r = train(openmoji / "train", tmp_path / "a", "train.steps=2", *DISTILL)
    assert r.returncode == 2 and "--image-model" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    r = train(teacher_data["data"], tmp_path / "b", "train.steps=2", *DISTILL, "data.aug_cfg={color_jitter_prob: 0.5, "
              "color_jitter: [0.4, 0.4, 0.4, 0.1]}")
    assert r.returncode == 2 and "stored crops" in r.stderr, r.stderr[-2000:]


def test_the_teacher_row_is_the_drawn_captions_row():
    """With extra captions the decoder hands the teacher's row of the caption it drew this epoch (the
    same draw as the caption itself), and of the crop it replays."""
    import io

    from PIL import Image

    from mmpretrain.data.crop import ResizedCrop
    from mmpretrain.data.decode import SampleDecoder, draw_caption
    from mmpretrain.data.teacher import TeacherRows

    png = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 10, 10)).save(png, format="PNG")
    extra = ["second caption", "third caption"]
    rows = TeacherRows(crops=np.array([[0, 0, 30, 40], [1, 2, 20, 30], [0, 0, 30, 40]], dtype=np.int32),
                       image=np.arange(3 * 4, dtype=np.float16).reshape(3, 4),
                       text=np.full(4, 7, dtype=np.float16), extra=np.array([[8] * 4, [9] * 4], dtype=np.float16))
    dec = SampleDecoder(ResizedCrop(16), embeddings="ignore", needs={"teacher"})
    seen = set()
    for epoch in range(12):
        raw = {"__key__": "k", "__index__": 5, "png": png.getvalue(), "txt": b"first caption",
               "json": json.dumps({"captions": extra}).encode(), "__teacher__": rows}
        item = dec(raw, 0, epoch)
        pick = draw_caption(3, None, 0, epoch, "k")
        assert item["text"] == (["first caption"] + extra)[pick]
        assert float(item["teacher_text"][0]) == [7, 8, 9][pick]
        a = 1 + random.Random(f"0:{epoch}:5:teacher-crop").randrange(2)
        assert item["teacher_image"].tolist() == rows.image[a].astype(np.float32).tolist()
        seen.add((pick, a))
    assert len(seen) > 2  # both draws vary over epochs
    raw["__teacher__"] = rows._replace(extra=rows.extra[:1])  # embedded before the third caption was added
    with pytest.raises(Exception, match="missing_teacher"):
        for epoch in range(12):
            dec(dict(raw), 0, epoch)
