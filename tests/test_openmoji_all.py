"""demo:openmoji-all (every named OpenMoji emoji, Unicode subgroups as classes, base emoji kept on one
side), its second drawing style, and the several-captions path: one caption per epoch drawn by
(seed, epoch, key), its own embedding row, a resume that draws the same ones."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmpretrain.data.decode import SkipSample, caption_pool, draw_caption
from mmpretrain.data.tar import read_tar

from conftest import TEXT_MODEL, run_main, setup_run, train

pytestmark = pytest.mark.integration


def _catalog():
    from data_tools.sources import openmoji_all

    emoji, left = openmoji_all.list_emoji()
    return openmoji_all, emoji, left


def test_base_emoji_and_class_names():
    from data_tools.sources.openmoji_all import base_of, readable

    cp = lambda s: [int(c, 16) for c in s.split()]  # noqa: E731
    technologist = base_of(cp("1F9D1 200D 1F4BB"))
    assert base_of(cp("1F469 1F3FD 200D 1F4BB")) == base_of(cp("1F468 200D 1F4BB")) == technologist  # woman/man, tone
    assert base_of(cp("1F3C3 200D 2640 FE0F")) == base_of(cp("1F3C3 1F3FF")) == "1f3c3"  # woman running, dark tone
    assert base_of(cp("1F4BB")) != technologist  # the laptop is not the technologist
    assert readable("face-smiling") == "smiling face" and readable("food-fruit") == "fruit"
    assert readable("country-flag") == "country flag" and readable("transport-ground") == "ground transport"


def test_every_named_emoji_renders_as_one_glyph_and_the_split_keeps_variants_together():
    """On the whole catalog (no rendering): the ZWJ sequences, skin tones and flags are in it and lay out
    as one glyph; no base emoji on both sides; every class >= 5 held-out images and as many in training."""
    oa, emoji, left = _catalog()
    assert len(emoji) > 4000 and left["not_one_glyph"] == 0 and left["not_drawn"] == 0
    names = {e.name for e in emoji}
    assert {"woman technologist: medium skin tone", "man technologist", "flag: Germany", "red heart"} <= names
    train, test, classes = oa.split(emoji)
    assert len(train) + len(test) == len(emoji)
    assert not {e.base for e in train} & {e.base for e in test}
    on_test, on_train = Counter(e.label for e in test), Counter(e.label for e in train)
    assert len(classes) >= 50 and len(set(classes)) == len(classes)
    assert all(on_test[i] >= 5 and on_train[i] >= on_test[i] for i in range(len(classes)))
    assert sum(bool(e.captions) for e in emoji) > 500  # extra captions from the emoji package's aliases


def _noto_like(folder: Path, emoji) -> Path:
    """An ``emoji-datasource-google`` layout with a few 64-px PNGs made here (not the download)."""
    images = folder / "package/img/google/64"
    images.mkdir(parents=True)
    entries = []
    for i, e in enumerate(emoji):
        unified = "-".join(c.upper() for c in e.key.split("-"))
        Image.new("RGBA", (64, 64), (40 * i % 255, 120, 200, 255)).save(images / f"{e.key}.png")
        entries.append({"unified": unified, "image": f"{e.key}.png", "has_img_google": True})
    entries.append({"unified": "1F600", "image": "missing.png", "has_img_google": False})
    (folder / "package/emoji.json").write_text(json.dumps(entries))
    return folder


@pytest.fixture(scope="module")
def bed(tmp_path_factory) -> Path:
    """demo:openmoji-all's first 1,200 emoji at 32 px, with a second style for 40 of its held-out ones,
    built and embedded through the public commands."""
    from data_tools.sources import openmoji_all

    root = tmp_path_factory.mktemp("bed")
    emoji, _ = openmoji_all.list_emoji(1200)
    _, test, _ = openmoji_all.split(emoji)
    noto = _noto_like(root / "noto_src", [e for e in test if e.label is not None][:40])
    out = root / "bed"
    r = run_main("data_tools", "build", "demo:openmoji-all", "--out", str(out), "--image-size", "32",
                 "--shard-size", "300", "--limit", "1200", "--second-style", str(noto))
    assert r.returncode == 0, r.stderr
    r = run_main("data_tools", "embed", str(out), "--model", TEXT_MODEL)
    assert r.returncode == 0, r.stderr
    return out


def _samples(folder: Path) -> list[dict]:
    """A split's samples (the shards its sizes.json lists; not clip_benchmark's test/0.tar beside them),
    or a clip_benchmark root's."""
    from mmpretrain.data.manifest import read_sizes

    names = sorted(read_sizes(folder)) if (folder / "sizes.json").is_file() else ["0.tar"]
    return [s for n in names for s in read_tar(folder / n)]


def test_bed_layout_counts_and_credits(bed):
    manifest = json.loads((bed / "manifest.json").read_text())
    splits = manifest["splits"]
    train, test = _samples(bed / "train"), _samples(bed / "test")
    assert splits["train"] == len(train) and splits["test"] == len(test) and len(train) + len(test) == 1200
    metas = [json.loads(s["json"]) for s in train + test]
    assert not {m["base"] for m in map(json.loads, (s["json"] for s in train))} & {
        m["base"] for m in map(json.loads, (s["json"] for s in test))}
    classes = (bed / "classnames.txt").read_text().splitlines()
    assert classes == splits["classes"] and min(splits["test_per_class"]) >= 5
    labelled = [s for s in test if "label" in json.loads(s["json"])]
    wds = [s for s in read_tar(bed / "test/0.tar")]  # clip_benchmark's layout: the labelled held-out images
    assert sum(splits["test_per_class"]) == splits["test_labelled"] == len(labelled) == len(wds)
    assert any("captions" in m for m in metas) and all("subgroup" in m for m in metas if "label" in m)
    assert "Unicode" in manifest["attribution"] and "OpenMoji" in manifest["attribution"]
    style = json.loads((bed / "noto/manifest.json").read_text())
    assert style["license"] == "Apache-2.0" and "Noto" in style["attribution"]
    noto = list(read_tar(bed / "noto/test/0.tar"))
    assert len(noto) == style["images"] == splits["second_style"]["images"] == 40
    assert (bed / "noto/classnames.txt").read_text().splitlines() == classes
    test_keys = {s["__key__"]: s["txt"] for s in test}
    assert all(test_keys[s["__key__"]] == s["txt"] for s in noto)  # the same captions, held-out emoji only


def test_the_card_credits_the_evaluation_sets_manifests(bed, tmp_path):
    """Evaluation on the Noto set records its manifest's licence and attribution; the export's card credits it
    (once), beside the training data's credit."""
    from mmpretrain.eval.datasets import load_dataset
    from mmpretrain.export.card import model_card
    from mmpretrain.run_files import RunFolder

    noto = load_dataset(str(bed / "noto"))
    assert noto.credit["license"] == "Apache-2.0" and "Noto" in noto.credit["attribution"]
    assert load_dataset(str(bed)).credit["license"] == "CC BY-SA 4.0"  # the OpenMoji bed's own clip_benchmark root
    run = tmp_path / "run"
    run.mkdir()
    train_credit = json.loads((bed / "train/manifest.json").read_text())
    (run / "provenance.json").write_text(json.dumps({"data": [{"spec": "train", "license": "CC BY-SA 4.0",
                                                               "attribution": train_credit["attribution"]}]}))
    entry = {"task": "zeroshot_classification", "metrics": {"acc1": 0.5}, "data": noto.credit}
    (run / "results.json").write_text(json.dumps({"results": [dict(entry, dataset="noto-test")] * 2}))
    card = model_card(RunFolder(run), {"vision_cfg": {"image_size": 64}, "text_cfg": {}}, None)
    assert card.count("Evaluation data (noto-test, Apache-2.0): ") == 1 and "Noto" in card
    assert card.count(train_credit["attribution"]) == 1  # the training credit is not repeated as evaluation data


def test_second_style_and_rebuild_refusals(bed, tmp_path):
    r = run_main("data_tools", "build", "demo:openmoji-all", "--out", str(tmp_path / "x"), "--second-style",
                 str(tmp_path / "nowhere"))
    assert r.returncode == 2 and "make noto" in r.stderr and "Traceback" not in r.stderr
    r = run_main("data_tools", "build", "demo:openmoji", "--out", str(tmp_path / "y"), "--second-style", str(bed))
    assert r.returncode == 2 and "demo:openmoji-all" in r.stderr
    copy = tmp_path / "bed"
    shutil.copytree(bed, copy)
    (copy / "noto/notes.txt").write_text("mine")
    r = run_main("data_tools", "build", "demo:openmoji-all", "--out", str(copy), "--limit", "300", "--overwrite")
    assert r.returncode == 0, r.stderr
    # a rebuild without the second style removes the old one's files, never a user's
    assert (copy / "noto/notes.txt").read_text() == "mine" and not (copy / "noto/test/0.tar").exists()


def test_caption_draws_are_seeded_weighted_and_checked():
    raw = {"__key__": "k", "txt": b"a", "json": json.dumps({"captions": ["b", "c"]}).encode()}
    extra, weights = caption_pool(raw)
    assert extra == ["b", "c"] and weights is None
    draws = [draw_caption(3, None, 0, epoch, "k") for epoch in range(60)]
    assert draws == [draw_caption(3, None, 0, epoch, "k") for epoch in range(60)]  # deterministic
    assert set(draws) == {0, 1, 2} and draws != [draw_caption(3, None, 1, epoch, "k") for epoch in range(60)]
    assert {draw_caption(3, [0, 1, 0], 0, e, "k") for e in range(40)} == {1}
    heavy = Counter(draw_caption(2, [9, 1], 0, e, "k") for e in range(2000))
    assert 0.85 < heavy[0] / 2000 < 0.95
    for bad in ({"captions": "b"}, {"captions": ["b", ""]}, {"captions": ["b"], "caption_weights": [1]},
                {"captions": ["b"], "caption_weights": [1, -1]}, {"captions": ["b"], "caption_weights": [0, 0]}):
        with pytest.raises(SkipSample, match="bad_captions"):
            caption_pool({"json": json.dumps(bad).encode()})
    assert caption_pool({"json": b"{}"}) == ([], None) and caption_pool({}) == ([], None)


def test_the_stream_hands_over_the_drawn_captions_row(bed, tmp_path):
    """Every sample's target embedding is the sidecar row of the caption the batch trains on (caption 0
    or an extra one), i.e. MiniLM's embedding of that text; some batches train on extra captions;
    data.captions=first never does."""
    from sentence_transformers import SentenceTransformer

    pools = {s["__key__"]: [s["txt"].decode(), *json.loads(s["json"]).get("captions", [])]
             for s in _samples(bed / "train")}
    encoder = SentenceTransformer(TEXT_MODEL, device="cpu")
    for mode in ("sample", "first"):
        run = setup_run(bed / "train", tmp_path / mode, "data.batch_size=64", "data.num_workers=0",
                        "train.steps=4", f"data.captions={mode}")
        extra = 0
        for batch, _ in zip(run.loader, range(4)):
            for key, text in zip(batch.keys, batch.texts):
                assert text in pools[key]
                extra += text != pools[key][0]
            want = encoder.encode(batch.texts, normalize_embeddings=True, convert_to_numpy=True)
            got = batch.target_embeddings.numpy()
            assert np.abs(got - want).max() < 2e-3
        assert (extra > 0) == (mode == "sample"), (mode, extra)


def test_several_captions_resume_bit_identically(bed, tmp_path):
    common = ["train.steps=6", "data.batch_size=32", "data.num_workers=2", "data.shuffle_buffer=64",
              "train.save_every=3", "train.log_every=1"]
    a, b = tmp_path / "a", tmp_path / "b"
    assert train(bed / "train", a, *common).returncode == 0
    shutil.copytree(a, b)
    shutil.rmtree(b / "checkpoints/step_00000006")
    (b / "log.jsonl").write_text("\n".join((a / "log.jsonl").read_text().splitlines()[:3]) + "\n")
    r = train(bed / "train", b, *common)
    assert r.returncode == 0 and "step 3" in r.stderr, r.stderr[-2000:]
    from safetensors.torch import load_file

    wa, wb = (load_file(x / "checkpoints/step_00000006/model.safetensors") for x in (a, b))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    la, lb = ([json.loads(x)["loss"] for x in (r_ / "log.jsonl").read_text().splitlines() if '"loss"' in x]
              for r_ in (a, b))
    assert la == lb and len(la) == 6


def test_embed_extra_rows_follow_the_captions(bed):
    from mmpretrain.data.sidecar import EXTRA_SUFFIXES, read_index

    index = read_index(str(bed / "train"))
    assert index["version"] == 2 and index["extra_captions"] > 0
    name, record = next((n, r) for n, r in index["shards"].items() if r["extra"])
    offsets = np.load(bed / "train" / (name + EXTRA_SUFFIXES[1]))
    rows = np.load(bed / "train" / (name + EXTRA_SUFFIXES[0]))
    samples = list(read_tar(bed / "train" / name))
    assert offsets[-1] == record["extra"] == len(rows) and len(offsets) == len(samples) + 1
    counts = [len(json.loads(s["json"]).get("captions", [])) for s in samples]
    assert list(np.diff(offsets)) == counts  # (the rows' values are checked against the encoder in the stream test)



def test_captions_embedded_before_their_rows_are_refused_with_the_fix(bed, tmp_path):
    """A version-1 embeddings.json (caption 0 only) beside shards with extra captions: refused at start,
    naming `data_tools embed` and data.captions=first; with data.captions=first it trains."""
    copy = tmp_path / "train"
    shutil.copytree(bed / "train", copy)
    index = json.loads((copy / "embeddings.json").read_text())
    for k in ("version", "extra_captions"):
        index.pop(k)
    (copy / "embeddings.json").write_text(json.dumps(index))
    r = train(copy, tmp_path / "r", "train.steps=2", "data.batch_size=16", "data.num_workers=0")
    assert r.returncode == 2 and "data_tools embed" in r.stderr and "data.captions=first" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    r = train(copy, tmp_path / "r2", "train.steps=2", "data.batch_size=16", "data.num_workers=0", "data.captions=first")
    assert r.returncode == 0, r.stderr[-2000:]
