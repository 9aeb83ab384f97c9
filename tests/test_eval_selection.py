"""Task image_caption_selection on SugarCrepe's and Winoground's layouts: equal to clip_benchmark's own
evaluation of the same exported model (its CLI for SugarCrepe, its evaluate for Winoground), the
metric against a naive reference, bad data counted or refused, and evaluation during training."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import ROOT, run_main, train


@pytest.fixture(scope="module")
def exported(demo_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "model"
    r = run_main("mmpretrain.export", str(demo_run), "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def _ours(model: str, *args: str, tmp_path) -> dict:
    results = tmp_path / "results.json"
    r = run_main("mmpretrain.eval", "--model", model, *args, "--task", "image_caption_selection",
                 "--num_workers", "0", "--output", str(results))
    assert r.returncode == 0, r.stderr[-3000:]
    return {e["dataset"]: e for e in json.loads(results.read_text())["results"]}


def test_sugar_crepe_equals_clip_benchmark_cli(exported, sugar_crepe, tmp_path):
    from mmpretrain.testing.clip_benchmark_anchor import clip_benchmark_cli

    ours = _ours(str(exported), "--dataset", f"sugar_crepe:{sugar_crepe}", tmp_path=tmp_path)
    assert set(ours) == {"sugar_crepe/swap_obj", "sugar_crepe/replace_obj"}  # one entry per split present
    for name, entry in ours.items():
        theirs = clip_benchmark_cli("--model", f"local-dir:{exported}", "--pretrained", "none", "--dataset", name,
                                    "--dataset_root", str(sugar_crepe), "--task", "image_caption_selection",
                                    "--no_amp", "--num_workers", "0", "--batch_size", "64")
        n = len(json.loads((sugar_crepe / f"{name.split('/')[1]}.json").read_text()))
        assert entry["n"] == n > 40
        assert set(entry["metrics"]) == set(theirs)
        for k, v in theirs.items():
            assert entry["metrics"][k] == pytest.approx(v, abs=1e-6), (name, k)
        assert entry["chance"] == {"image_acc": 1.0, "text_acc": 0.5, "acc": 0.5}
        assert entry["metrics"]["image_acc"] == 1.0 and entry["metrics"]["text_acc"] == entry["metrics"]["acc"]


def test_winoground_equals_clip_benchmark_evaluate(exported, winoground, tmp_path):
    import open_clip

    from mmpretrain.testing.clip_benchmark_anchor import clip_benchmark_winoground

    model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{exported}")
    tokenizer = open_clip.get_tokenizer(f"local-dir:{exported}")
    theirs = clip_benchmark_winoground(model, preprocess, tokenizer, winoground)
    ours = _ours(str(exported), "--dataset", f"winoground:{winoground}", tmp_path=tmp_path)["winoground"]
    assert ours["n"] == 40
    for k, v in theirs.items():
        assert ours["metrics"][k] == pytest.approx(v, abs=1e-6), k
    # Winoground's chance levels: text 1/4, image 1/4, group 1/6
    assert ours["chance"] == pytest.approx({"image_acc": 0.25, "text_acc": 0.25, "acc": 1 / 6}, abs=1e-12)
    # a plain saved dataset with image_<i> / caption_<j> columns is taken too, named after its folder
    assert _ours(str(exported), "--dataset", str(winoground), tmp_path=tmp_path)["winoground"]["metrics"] == \
        ours["metrics"]


def test_metric_equals_a_naive_loop():
    """clip_benchmark's decision rule written out: every image picks its caption (text), every caption its
    image (image), both (acc); ties to the lower index."""
    from mmpretrain.eval.selection import decisions, selection_metrics

    g = torch.Generator().manual_seed(0)
    mats = [torch.randn(2, 2, generator=g) for _ in range(200)] + [torch.tensor([[1.0, 1.0], [0.0, 2.0]])]
    text, image = zip(*(decisions(m) for m in mats))
    naive_text = [all(max(range(2), key=lambda j: (m[i, j].item(), -j)) == i for i in range(2)) for m in mats]
    naive_image = [all(max(range(2), key=lambda i: (m[i, j].item(), -i)) == j for j in range(2)) for m in mats]
    assert list(text) == naive_text and list(image) == naive_image
    got = selection_metrics(list(text), list(image))
    assert got["acc"] == pytest.approx(sum(t and i for t, i in zip(naive_text, naive_image)) / len(mats), abs=1e-6)
    assert decisions(torch.tensor([[0.3, 0.3]])) == (True, True)  # a tie goes to caption 0, as argmax does


def test_bad_data_is_counted_or_refused(exported, sugar_crepe, tmp_path):
    broken = tmp_path / "sc"
    shutil.copytree(sugar_crepe, broken)
    ann = json.loads((broken / "swap_obj.json").read_text())
    keys = list(ann)
    ann[keys[0]] = {"filename": ann[keys[0]]["filename"], "caption": "x"}  # no negative_caption
    ann[keys[1]]["filename"] = "missing.jpg"
    (broken / "val2017" / ann[keys[2]]["filename"]).write_bytes(b"not a jpeg")
    (broken / "swap_obj.json").write_text(json.dumps(ann))
    results = tmp_path / "r.json"
    r = run_main("mmpretrain.eval", "--model", str(exported), "--dataset", f"sugar_crepe/swap_obj:{broken}",
                 "--task", "image_caption_selection", "--num_workers", "0", "--output", str(results))
    assert r.returncode == 0, r.stderr[-2000:]
    entry = json.loads(results.read_text())["results"][0]
    assert entry["skipped"] == {"malformed_annotation": 1, "missing_image": 1, "undecodable_image": 1}
    assert entry["n"] == len(keys) - 3
    for spec, code, words in ((f"sugar_crepe:{tmp_path / 'nothing'}", 2, "no SugarCrepe annotation file"),
                              (f"sugar_crepe/swap_all:{broken}", 2, "not a SugarCrepe split"),
                              (str(tmp_path / "nowhere"), 2, "no such folder")):
        r = run_main("mmpretrain.eval", "--model", str(exported), "--dataset", spec, "--task", "image_caption_selection")
        assert r.returncode == code and words in r.stderr and "Traceback" not in r.stderr, (spec, r.stderr[-500:])
    (broken / "replace_obj.json").write_text("{not json")
    r = run_main("mmpretrain.eval", "--model", str(exported), "--dataset", f"sugar_crepe/replace_obj:{broken}",
                 "--task", "image_caption_selection")
    assert r.returncode == 1 and "is not JSON" in r.stderr


def test_two_ranks_equal_one_process(exported, sugar_crepe, winoground, tmp_path):
    from ddp_helpers import run_ranks

    res = run_ranks(_rank_eval, (str(exported), str(sugar_crepe), str(winoground)), tmp_path, world=2)
    one = _rank_eval(0, 1, str(exported), str(sugar_crepe), str(winoground))
    assert json.dumps(res[0]) == json.dumps(res[1]) == json.dumps(one)


def _rank_eval(rank, world, model_dir, sc, wino):
    from mmpretrain.eval import evaluate
    from mmpretrain.models.from_disk import load_model

    model, preprocess, tokenizer = load_model(model_dir, device="cpu")
    return [evaluate(model, preprocess, tokenizer, spec, "image_caption_selection", batch_size=16, num_workers=1,
                     rank=rank, world_size=world)
            for spec in (f"sugar_crepe/swap_obj:{sc}", f"winoground:{wino}")]


def test_evaluated_during_training(openmoji, sugar_crepe, tmp_path):
    run_dir = tmp_path / "run"
    r = train(openmoji / "train", run_dir, "train.steps=2", "data.batch_size=16", "data.num_workers=0",
              f"eval={{every: 2, datasets: ['sugar_crepe:{sugar_crepe}'], tasks: [image_caption_selection], "
              "num_workers: 0}", config=ROOT / "configs/tiny/clip.yaml")
    assert r.returncode == 0, r.stderr[-3000:]
    last = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()][-1]
    assert {"eval/sugar_crepe/swap_obj/text_acc", "eval/sugar_crepe/replace_obj/acc"} <= set(last)
    r = train(openmoji / "train", tmp_path / "run2", "train.steps=2",
              f"eval={{every: 2, datasets: ['sugar_crepe:{tmp_path}'], tasks: [image_caption_selection]}}",
              config=ROOT / "configs/tiny/clip.yaml")
    assert r.returncode == 2 and "eval.datasets.0" in r.stderr and "no SugarCrepe annotation file" in r.stderr
