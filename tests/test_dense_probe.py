"""The dense probe (``--task dense_probe``): patch labels, metrics and the whole task against naive per-image,
per-patch and per-pixel loops on demo:mnist's stroke maps (built by data_tools); 2 ranks; bad label maps
counted; refusals."""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from mmpretrain.eval import evaluate
from mmpretrain.eval.dense_probe import dense_metrics, fit_probe, patch_labels, patch_tokens
from mmpretrain.models.from_disk import load_model

from conftest import run_main, shared
from ddp_helpers import run_ranks


@pytest.fixture(scope="module")
def mnist(tmp_path_factory):
    """demo:mnist with 160 training and 40 held-out digits, its dense/ set included."""
    def make(folder):
        out = folder / "mnist"
        r = run_main("data_tools", "build", "demo:mnist", "--out", str(out), "--image-size", "32", "--limit", "160")
        assert r.returncode == 0, r.stderr[-3000:]
        return out

    return shared(tmp_path_factory, "mnist_dense", make)


def _model():
    torch.manual_seed(0)
    model, preprocess, tokenizer = load_model("mmpt-tiny-vit", device="cpu")
    return model.eval(), preprocess, tokenizer


def test_the_build_writes_stroke_maps_of_the_digits(mnist):
    from data_tools.sources import mnist as src

    x, y = src.load()
    classes = (mnist / "dense/classnames.txt").read_text().split()
    assert classes[0] == "background" and len(classes) == 11
    with tarfile.open(mnist / "dense/test/0.tar") as t:
        members = {m.name: t.extractfile(m).read() for m in t.getmembers()}
    keys = sorted({n.split(".")[0] for n in members})
    assert len(keys) == 40 and json.loads((mnist / "manifest.json").read_text())["splits"]["dense"] == {
        "train": 160, "test": 40}
    for key in keys[:5]:
        i = int(key.removeprefix("mnist"))
        seg = np.array(Image.open(io.BytesIO(members[f"{key}.seg.png"])))
        assert set(np.unique(seg)) == {0, 1 + int(y[i])}
        assert ((seg > 0) == (x[i] >= 128)).all()  # the strokes, pixel for pixel
        assert np.array_equal(np.array(Image.open(io.BytesIO(members[f"{key}.png"])).convert("L")), x[i])


def naive_patch_labels(pixels, h, w, classes):
    b, hh, ww = pixels.shape
    ph, pw = hh // h, ww // w
    out = torch.zeros(b, h, w, dtype=torch.long)
    for n in range(b):
        for i in range(h):
            for j in range(w):
                counts = [0] * classes
                for v in pixels[n, i * ph:(i + 1) * ph, j * pw:(j + 1) * pw].flatten().tolist():
                    counts[v] += 1
                out[n, i, j] = counts.index(max(counts))  # ties: the smaller label
    return out


def naive_metrics(pred, truth, classes):
    p, t = pred.flatten().tolist(), truth.flatten().tolist()
    ious = []
    for c in range(classes):
        inter = sum(1 for a, b in zip(p, t) if a == c and b == c)
        union = sum(1 for a, b in zip(p, t) if a == c or b == c)
        if union:
            ious.append(inter / union)
    return sum(ious) / len(ious), sum(1 for a, b in zip(p, t) if a == b) / len(p)


def test_patch_labels_and_metrics_equal_naive_loops():
    g = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 4, (3, 12, 12), generator=g)
    assert torch.equal(patch_labels(pixels, (3, 3), 4), naive_patch_labels(pixels, 3, 3, 4))
    ties = torch.tensor([[[2, 1], [1, 2]]])  # two of each: the smaller label
    assert patch_labels(ties, (1, 1), 3).item() == 1
    pred = torch.randint(0, 4, (3, 12, 12), generator=g)
    miou, acc = naive_metrics(pred, pixels, 5)  # class 4 in neither: left out of the mean
    m = dense_metrics(pred, pixels, 5)
    assert m["dense_miou"] == pytest.approx(miou, abs=1e-12) and m["dense_pixel_acc"] == pytest.approx(acc, abs=1e-12)


def _naive_split(model, preprocess, folder):
    """Per image: its tokens alone through forward_intermediates, its label map resized and cropped by PIL."""
    size = model.visual.image_size[0]
    feats, labels, pixels = [], [], []
    with tarfile.open(folder / "0.tar") as t:
        members = {m.name: t.extractfile(m).read() for m in t.getmembers()}
    for key in dict.fromkeys(n.split(".")[0] for n in members):  # the tar's order, the dataset's
        image = Image.open(io.BytesIO(members[f"{key}.png"])).convert("RGB")
        seg = Image.open(io.BytesIO(members[f"{key}.seg.png"]))
        w, h = seg.size
        s = size / min(w, h)
        seg = seg.resize((round(w * s), round(h * s)), Image.NEAREST)
        left, top = (seg.width - size) // 2, (seg.height - size) // 2
        px = torch.from_numpy(np.array(seg.crop((left, top, left + size, top + size)), dtype=np.int64))
        with torch.no_grad():
            tok = patch_tokens(model.visual, preprocess(image)[None])[0]  # (D, h, w)
        feats.append(tok.flatten(1).T)
        labels.append(naive_patch_labels(px[None], tok.shape[1], tok.shape[2], 11)[0].flatten())
        pixels.append(px)
    return torch.stack(feats), torch.stack(labels), torch.stack(pixels)


def test_the_dense_probe_equals_a_naive_per_image_pipeline(mnist):
    model, preprocess, tokenizer = _model()
    ours = evaluate(model, preprocess, tokenizer, str(mnist / "dense"), "dense_probe", batch_size=16, num_workers=2)
    tr_x, tr_y, _ = _naive_split(model, preprocess, mnist / "dense/train")
    te_x, te_y, te_px = _naive_split(model, preprocess, mnist / "dense/test")
    clf, best = fit_probe(tr_x, tr_y)
    pred = torch.from_numpy(clf.predict(te_x.reshape(-1, te_x.shape[-1]).numpy())).reshape(len(te_x), 4, 4)
    spread = pred.repeat_interleave(8, 1).repeat_interleave(8, 2)  # each 8 px patch over its pixels
    miou, acc = naive_metrics(spread, te_px, 11)
    assert ours["n"] == 40 and ours["n_train"] == 160 and ours["C"] == best and ours["patches"] == [4, 4]
    assert ours["metrics"]["dense_miou"] == pytest.approx(miou, abs=1e-9)
    assert ours["metrics"]["dense_pixel_acc"] == pytest.approx(acc, abs=1e-9)
    assert ours["metrics"]["dense_patch_acc"] == pytest.approx((pred.flatten(1) == te_y).double().mean().item())
    assert 0 < ours["chance"]["dense_miou"] < ours["metrics"]["dense_miou"]  # background everywhere: one class's IoU


def _dense_job(rank, world, root):
    model, preprocess, tokenizer = _model()
    return evaluate(model, preprocess, tokenizer, str(root / "dense"), "dense_probe", batch_size=16, rank=rank,
                    world_size=world)


def test_two_ranks_equal_one(mnist, tmp_path):
    single = _dense_job(0, 1, mnist)
    ranks = run_ranks(_dense_job, (mnist,), tmp_path, world=2)
    assert json.dumps(ranks[0]) == json.dumps(ranks[1]) and ranks[0]["metrics"] == single["metrics"]


def test_bad_label_maps_are_counted_and_missing_ones_explained(mnist, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(mnist / "dense", bad)
    src, dst = bad / "test/0.tar", bad / "test/new.tar"
    with tarfile.open(src) as t, tarfile.open(dst, "w") as out:
        broken = 0
        for m in t.getmembers():
            data = t.extractfile(m).read()
            if m.name.endswith(".seg.png") and broken < 3:
                data, broken = b"not a png", broken + 1
            m.size = len(data)
            out.addfile(m, io.BytesIO(data))
    dst.replace(src)
    r = run_main("mmpretrain.eval", "--model", "mmpt-tiny-vit", "--dataset", str(bad), "--task", "dense_probe",
                 "--num_workers", "0")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "skipped {'missing_label_map': 3}" in r.stderr and "dense_miou" in r.stdout
    r = run_main("mmpretrain.eval", "--model", "mmpt-tiny-vit", "--dataset", str(mnist), "--task", "dense_probe",
                 "--num_workers", "0")  # the image-level split: no label maps
    assert r.returncode == 1 and "no samples with a label map (seg.png)" in r.stderr and "Traceback" not in r.stderr


def test_a_tower_without_patch_tokens_is_refused():
    with pytest.raises(ValueError, match="reads an open_clip ViT's patch tokens"):
        patch_tokens(torch.nn.Linear(2, 2), torch.zeros(1, 3, 8, 8))


def test_the_emoji_dense_set_holds_their_alpha_and_probes(openmoji):
    """demo:openmoji's dense/: each labelled emoji on white with its glyph's alpha as the label map."""
    classes = (openmoji / "dense/classnames.txt").read_text().splitlines()
    assert classes[0] == "background" and classes[1:] == (openmoji / "classnames.txt").read_text().splitlines()
    with tarfile.open(openmoji / "dense/test/0.tar") as t:
        members = {m.name: t.extractfile(m).read() for m in t.getmembers()}
    keys = list(dict.fromkeys(n.split(".")[0] for n in members))
    assert len(keys) >= 10
    for key in keys:
        seg = np.array(Image.open(io.BytesIO(members[f"{key}.seg.png"])))
        image = np.array(Image.open(io.BytesIO(members[f"{key}.png"])).convert("L"))
        cls = int(members[f"{key}.cls"])
        assert set(np.unique(seg)) == {0, 1 + cls} and 0.05 < (seg > 0).mean() < 0.95
        assert image[seg == 0].mean() > 235  # outside the glyph: the white canvas
    r = run_main("mmpretrain.eval", "--model", "mmpt-tiny-vit", "--dataset", str(openmoji / "dense"), "--task",
                 "dense_probe", "--num_workers", "0")
    assert r.returncode == 0 and "dense_miou" in r.stdout, r.stderr[-3000:]
