"""Probe metrics on real packaged data (scikit-learn's 8x8 digits as features) against references."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mmpretrain.eval.clustering import clustering_metrics
from mmpretrain.eval.knn import knn_accuracy
from mmpretrain.eval.linear_probe import linear_probe
from mmpretrain.eval.zero_shot import classification_metrics


@pytest.fixture(scope="module")
def digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    x = F.normalize(torch.tensor(d.data, dtype=torch.float32), dim=-1)
    y = torch.tensor(d.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    return x[:1200], y[:1200], x[1200:], y[1200:]


def test_knn_matches_naive_weighted_vote(digits):
    tr_x, tr_y, te_x, te_y = digits
    acc = knn_accuracy(tr_x, tr_y, te_x, te_y, 10, k=7)
    correct = 0
    for i in range(len(te_y)):
        sims = [(float(te_x[i] @ tr_x[j]), int(tr_y[j])) for j in range(len(tr_y))]
        votes = np.zeros(10)
        for s, c in sorted(sims, reverse=True)[:7]:
            votes[c] += np.exp(s / 0.07)
        correct += int(votes.argmax() == int(te_y[i]))
    assert acc == pytest.approx(correct / len(te_y))
    assert acc > 0.9  # digits are nearly separable by pixels


def test_linear_probe_and_metrics(digits):
    tr_x, tr_y, te_x, te_y = digits
    metrics, c = linear_probe(tr_x, tr_y, te_x, te_y, 10)
    assert set(metrics) == {"lp_acc1", "lp_acc5", "lp_mean_per_class_recall"}
    assert metrics["lp_acc1"] > 0.9 and metrics["lp_acc5"] >= metrics["lp_acc1"]
    assert c in (0.01, 0.1, 1.0, 10.0, 100.0)


def test_classification_metrics_by_hand():
    logits = torch.tensor([[0.9, 0.1, 0.0], [0.2, 0.7, 0.1], [0.5, 0.4, 0.1], [0.1, 0.2, 0.7]])
    labels = torch.tensor([0, 1, 1, 0])
    m = classification_metrics(logits, labels, 3)
    assert m["acc1"] == pytest.approx(0.5)
    assert m["mean_per_class_recall"] == pytest.approx(0.5)  # class 0: 1/2, class 1: 1/2


def test_clustering_metrics(digits):
    _, _, te_x, te_y = digits
    m = clustering_metrics(te_x, te_y, 10)
    assert 0.4 < m["ari"] <= 1.0
    from sklearn.metrics import silhouette_score

    assert m["silhouette_mean"] == pytest.approx(silhouette_score(te_x.numpy(), te_y.numpy(), metric="cosine"),
                                                 abs=1e-6)
    shuffled = clustering_metrics(te_x, te_y[torch.randperm(len(te_y), generator=torch.Generator().manual_seed(1))], 10)
    assert abs(shuffled["ari"]) < 0.05 and shuffled["silhouette_mean"] < m["silhouette_mean"]


@pytest.fixture(scope="module")
def tiny_model():
    from open_clip.transform import PreprocessCfg, image_transform_v2

    from mmpretrain.models.factory import (
        build_dual_encoder,
        default_preprocess_cfg,
        make_tokenizer,
        resolve_model_cfg,
    )

    cfg = resolve_model_cfg("mmpt-tiny-vit")
    clip = build_dual_encoder(cfg).clip.eval()
    return clip, image_transform_v2(PreprocessCfg(**default_preprocess_cfg(cfg)), is_train=False), make_tokenizer(cfg)


def test_image_folder_and_hf_datasets(tmp_path, tiny_model):
    import datasets
    from PIL import Image
    from sklearn.datasets import load_digits

    from mmpretrain.eval import evaluate
    from mmpretrain.eval.datasets import load_dataset

    d = load_digits()
    names = ["zero", "one", "two"]
    images, labels = [], []
    for i in range(60):
        c = int(d.target[i])
        if c < 3:
            img = Image.fromarray((d.images[i] * 15).astype("uint8")).resize((32, 32)).convert("RGB")
            (tmp_path / "folder" / names[c]).mkdir(parents=True, exist_ok=True)
            img.save(tmp_path / "folder" / names[c] / f"{i}.png")
            images.append(img)
            labels.append(c)
    ds = load_dataset(str(tmp_path / "folder"))
    assert ds.classnames == sorted(names)  # like torchvision's ImageFolder: sorted class folders
    assert sorted(ds.classnames[s.label] for s in ds) == sorted(names[c] for c in labels)
    model, preprocess, tokenizer = tiny_model
    res = evaluate(model, preprocess, tokenizer, ds, "zeroshot_classification")
    assert res["n"] == len(labels) and res["chance"]["acc1"] == pytest.approx(1 / 3)

    hf = datasets.Dataset.from_dict({"image": images, "label": labels}).cast_column(
        "label", datasets.ClassLabel(names=names))
    hf.save_to_disk(str(tmp_path / "hf"))
    ds = load_dataset(str(tmp_path / "hf"))
    assert ds.classnames == names and [s.label for s in ds] == labels
    assert evaluate(model, preprocess, tokenizer, ds, "zeroshot_classification")["n"] == len(labels)


def test_named_templates(tmp_path):
    from mmpretrain.eval.zero_shot import named_templates

    assert len(named_templates("openai_imagenet")) == 80
    assert all("{c}" in t for t in named_templates("simple_imagenet"))
    bad = tmp_path / "t.txt"
    bad.write_text("a photo\n")
    with pytest.raises(ValueError, match="placeholder"):
        named_templates(str(bad))


def test_probe_tasks_on_one_dataset_share_its_image_pass(openmoji, tiny_model, monkeypatch):
    """linear_probe, knn and clustering on the same dataset in one run encode each split once, and give
    what three separate runs give."""
    from mmpretrain.eval import Evaluator, evaluate, features

    model, preprocess, tokenizer = tiny_model
    passes = []
    real = features._image_features
    monkeypatch.setattr(features, "_image_features", lambda m, p, ds, ctx: passes.append(ds.name) or real(m, p, ds, ctx))
    tasks = ["linear_probe", "knn", "clustering"]
    shared = Evaluator([(str(openmoji), t) for t in tasks]).run(model, preprocess, tokenizer)
    assert sorted(passes) == sorted(["openmoji-test", "openmoji-train"])  # test and train split, once each
    separate = [evaluate(model, preprocess, tokenizer, str(openmoji), t) for t in tasks]
    assert len(passes) == 2 + (2 + 2 + 1)  # separately, each task encodes its splits again (clustering: test only)
    assert [e["metrics"] for e in shared] == [e["metrics"] for e in separate]
