"""Captioning: generation (greedy and beam search) against naive per-image loops through open_clip's
``CoCa.forward``; the COCO caption scores against clip_benchmark's and pycocoevalcap's own evaluators on the
same captions and files; ``python -m mmpretrain.eval --task captioning`` on a tiny CoCa trained from the CLI,
on 2 gloo ranks, through the open_clip export, and its refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from mmpretrain.eval import evaluate
from mmpretrain.eval.captioning import METRICS, caption_scores, ptb_tokenize_python, tokenize
from mmpretrain.models import factory
from mmpretrain.models.caption import decode_captions, generate

from conftest import ROOT, run_main, train
from ddp_helpers import run_ranks

CONFIG = ROOT / "configs/tiny/caption.yaml"
SOT, EOT = 49406, 49407
JAVA = shutil.which("java") is not None


def tiny_coca(seed: int = 0):
    torch.manual_seed(seed)
    factory.register_packaged_configs()
    coca = factory.instantiate(factory.resolve_model_cfg("mmpt-tiny-coca"), load_text_weights=False).double().eval()
    images = torch.randn(4, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return coca, images


def _logprobs(coca, image, seq):
    """The next token's log-probabilities through open_clip's own ``CoCa.forward`` (one image, one prefix)."""
    out = coca(image[None], torch.tensor([seq]), output_labels=False)
    return out["logits"][0, -1].log_softmax(-1)


def naive_greedy(coca, image, max_len, min_len):
    seq = [SOT]
    while len(seq) < max_len:
        lp = _logprobs(coca, image, seq)
        if len(seq) < min_len:
            lp[EOT] = -torch.inf
        tok = EOT if len(seq) == max_len - 1 else int(lp.argmax())
        seq.append(tok)
        if tok == EOT:
            break
    return seq


def naive_beam(coca, image, k, max_len, min_len, length_penalty=1.0):
    live, finished = [(0.0, [SOT])], []
    while True:
        t = len(live[0][1])
        cands = []
        for s, seq in live:
            lp = _logprobs(coca, image, seq)
            if t < min_len:
                lp[EOT] = -torch.inf
            if t == max_len - 1:
                lp[torch.arange(len(lp)) != EOT] = -torch.inf
            top = lp.topk(2 * k)  # the whole vocabulary's best 2k hold every candidate the merge below can keep
            cands += [(s + x, seq + [v]) for x, v in zip(top.values.tolist(), top.indices.tolist()) if x > -1e300]
        cands.sort(key=lambda c: -c[0])
        nxt = []
        for s, seq in cands[:2 * k]:
            if seq[-1] == EOT:
                finished = sorted(finished + [(s / len(seq) ** length_penalty, seq)], key=lambda h: -h[0])[:k]
            else:
                nxt.append((s, seq))
            if len(nxt) == k:
                break
        best_live = max((s for s, _ in nxt), default=-float("inf"))
        if t + 1 >= max_len or not nxt or (len(finished) == k and finished[-1][0] >= best_live / (t + 1) ** length_penalty):
            return max(finished, key=lambda h: h[0])[1]
        live = nxt


def _rows(ids):
    return [[x for x in row if x != 0] for row in ids.tolist()]


@torch.no_grad()
def test_greedy_equals_a_naive_loop_through_coca_forward():
    coca, images = tiny_coca()
    ids = generate(coca, images, sot=SOT, eot=EOT, max_len=10, min_len=4)
    assert _rows(ids) == [naive_greedy(coca, im, 10, 4) for im in images]
    assert all(len(r) >= 5 and r[-1] == EOT and r.count(EOT) == 1 for r in _rows(ids))  # min_len: 4 before the end


@pytest.mark.parametrize("k, length_penalty", [(3, 1.0), (2, 0.0)])
@torch.no_grad()
def test_beam_search_equals_a_naive_per_image_beam_search(k, length_penalty):
    coca, images = tiny_coca(1)
    ids = generate(coca, images, sot=SOT, eot=EOT, max_len=8, min_len=3, num_beams=k, length_penalty=length_penalty)
    assert _rows(ids) == [naive_beam(coca, im, k, 8, 3, length_penalty) for im in images]


def test_generation_refuses_a_tower_without_a_decoder_and_bad_lengths():
    factory.register_packaged_configs()
    clip = factory.instantiate(factory.resolve_model_cfg("mmpt-tiny-vit"), load_text_weights=False)
    with pytest.raises(ValueError, match="a CoCa model"):
        generate(clip, torch.zeros(1, 3, 32, 32), sot=SOT, eot=EOT)
    coca, images = tiny_coca()
    with pytest.raises(ValueError, match="min_len < max_len"):
        generate(coca, images, sot=SOT, eot=EOT, max_len=5, min_len=5)


def test_decode_cuts_at_the_end_token():
    tok = factory.make_tokenizer(factory.resolve_model_cfg("mmpt-tiny-coca"))
    ids = tok(["a red apple", "rocket"])
    assert decode_captions(ids, tok, SOT, EOT) == ["a red apple", "rocket"]


REFS = [["A man riding a wave on top of a surfboard.", "A surfer rides a large wave in the ocean!"],
        ["Two dogs play with a frisbee in the park.", "two dogs, playing on grass", "Dogs don't stop; they run."],
        ["a red apple", "an apple (red) on a table"], ["grinning face with big eyes"]]
CANDS = ["a man riding a wave on a surfboard", "two dogs playing with a frisbee", "a red apple on a table",
         "a grinning face"]


class _Skipped:
    """Stands in for METEOR and SPICE (a 2 GB Java process; a CoreNLP download) in the reference evaluators."""

    def compute_score(self, gts, res):
        return 0.0, [0.0] * len(gts)

    def method(self):
        return "skipped"


@pytest.mark.skipif(not JAVA, reason="PTBTokenizer, COCO's tokenizer, is Java")
def test_scores_equal_clip_benchmarks_captioning_evaluator(monkeypatch):
    from clip_benchmark.metrics import captioning as cb

    monkeypatch.setattr(cb, "Meteor", _Skipped)
    monkeypatch.setattr(cb, "Spice", _Skipped)
    ev = cb.COCOEvalCap([{"image_id": i, "gen": [{"caption": c}], "true": [{"caption": r} for r in refs]}
                         for i, (c, refs) in enumerate(zip(CANDS, REFS))])
    ev.evaluate()
    ours = caption_scores(REFS, CANDS, "ptb")
    assert set(ours) == set(METRICS)
    for k in METRICS:
        assert ours[k] == pytest.approx(ev.eval[k], abs=1e-12), k
    assert 0.3 < ours["Bleu_4"] < 1 and ours["CIDEr"] > 0.5  # a real score, not a degenerate 0 or 1
    assert caption_scores(REFS, [r[0] for r in REFS], "ptb")["Bleu_4"] == pytest.approx(1.0)  # a reference itself


@pytest.mark.skipif(not JAVA, reason="PTBTokenizer, COCO's tokenizer, is Java")
def test_the_python_tokenizer_equals_ptb_on_caption_text(openmoji):
    from mmpretrain.eval.datasets import load_dataset

    texts = [c for refs in REFS for c in refs] + CANDS + ["It's a \"quoted\" word -- and a t-shirt, isn't it?"]
    texts += [c for s in load_dataset(str(openmoji / "test")) for c in s.captions]
    ptb = tokenize(dict(enumerate([t] for t in texts)), "ptb")
    assert [ptb[i][0] for i in range(len(texts))] == [ptb_tokenize_python(t) for t in texts]


@pytest.fixture(scope="module")
def coca_run(openmoji, tmp_path_factory):
    run = tmp_path_factory.mktemp("coca") / "run"
    r = train(openmoji / "train", run, "train.steps=20", "data.num_workers=1", config=CONFIG)
    assert r.returncode == 0, r.stderr[-3000:]
    return run


GEN = ["--num-beams", "2", "--max-caption-len", "10", "--batch_size", "64", "--num_workers", "1"]


def test_captioning_from_the_cli_scores_its_captions_file_as_pycocoevalcap_does(coca_run, openmoji, tmp_path,
                                                                               monkeypatch):
    out = tmp_path / "results.json"
    # with a probe beside it: a CoCa tower returns (pooled, tokens), and its pre-projection features are the pooled
    r = run_main("mmpretrain.eval", "--model", str(coca_run), "--dataset", str(openmoji / "test"), str(openmoji),
                 "--task", "captioning", "linear_probe", "--output", str(out), *GEN)
    assert r.returncode == 0, r.stderr[-3000:]
    entry, probe = json.loads(out.read_text())["results"]
    assert probe["metrics"]["lp_acc1_preproj"] > 0
    assert set(entry["metrics"]) == set(METRICS) and entry["generation"] == {"num_beams": 2, "max_len": 10,
                                                                             "min_len": 5}
    assert "CIDEr" in r.stdout and "captions:" in r.stdout
    rows = [json.loads(x) for x in open(entry["captions_file"], encoding="utf-8")]
    truth = [s.captions for s in __import__("mmpretrain.eval.datasets", fromlist=["x"]).load_dataset(
        str(openmoji / "test"))]
    assert [x["index"] for x in rows] == list(range(len(truth))) and [x["references"] for x in rows] == truth
    assert entry["n"] == len(rows) and all(x["caption"] for x in rows)
    # the same files through pycocoevalcap's own COCO evaluator (pycocotools' COCO and loadRes)
    ann = tmp_path / "captions_gt.json"
    ann.write_text(json.dumps({"images": [{"id": x["index"]} for x in rows], "annotations": [
        {"image_id": x["index"], "id": j * 100 + i, "caption": c} for j, x in enumerate(rows)
        for i, c in enumerate(x["references"])]}))
    res = tmp_path / "captions_res.json"
    res.write_text(json.dumps([{"image_id": x["index"], "caption": x["caption"]} for x in rows]))
    if JAVA:
        import pycocoevalcap.eval as pe
        from pycocotools.coco import COCO

        monkeypatch.setattr(pe, "Meteor", _Skipped)
        monkeypatch.setattr(pe, "Spice", _Skipped)
        coco = COCO(str(ann))
        ev = pe.COCOEvalCap(coco, coco.loadRes(str(res)))
        ev.evaluate()
        assert entry["tokenizer"] == "ptb"
        for k in METRICS:
            assert entry["metrics"][k] == pytest.approx(ev.eval[k], abs=1e-12), k


def test_captioning_on_two_ranks_equals_one(coca_run, openmoji, tmp_path):
    single = _caption_job(0, 1, coca_run, openmoji)
    ranks = run_ranks(_caption_job, (coca_run, openmoji), tmp_path, world=2)
    assert json.dumps(ranks[0]) == json.dumps(ranks[1])
    assert ranks[0]["captions"] == single["captions"] and ranks[0]["metrics"] == single["metrics"]


def _caption_job(rank, world, run, root):
    from mmpretrain.models.from_disk import load_model

    model, preprocess, tokenizer = load_model(str(run))
    return evaluate(model, preprocess, tokenizer, str(root / "test"), "captioning", batch_size=32, rank=rank,
                    world_size=world, generation={"num_beams": 2, "max_len": 8, "min_len": 3})


def test_the_open_clip_export_generates_the_runs_captions(coca_run, openmoji, tmp_path):
    export = tmp_path / "export"
    r = run_main("mmpretrain.export", str(coca_run), "--out", str(export))
    assert r.returncode == 0, r.stderr[-3000:]
    import open_clip

    model, _, preprocess = open_clip.create_model_and_transforms("local-dir:" + str(export))
    assert isinstance(model, open_clip.CoCa)
    captions = []
    for spec in (coca_run, export):
        out = tmp_path / f"{spec.name}.json"
        r = run_main("mmpretrain.eval", "--model", str(spec), "--dataset", str(openmoji / "test"), "--task",
                     "captioning", "--output", str(out), *GEN)
        assert r.returncode == 0, r.stderr[-3000:]
        (entry,) = json.loads(out.read_text())["results"]
        captions.append([json.loads(x)["caption"] for x in open(entry["captions_file"], encoding="utf-8")])
    assert captions[0] == captions[1]


def test_captioning_refuses_a_model_without_a_decoder(demo_run, openmoji):
    r = run_main("mmpretrain.eval", "--model", str(demo_run), "--dataset", str(openmoji / "test"), "--task",
                 "captioning")
    assert r.returncode == 2 and "needs a model with a caption decoder" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    r = run_main("mmpretrain.eval", "--model", str(demo_run), "--dataset", str(openmoji / "test"), "--task",
                 "captioning", "--num-beams", "0")
    assert r.returncode == 2 and "--num-beams must be >= 1" in r.stderr


@pytest.mark.skipif(not JAVA, reason="PTBTokenizer, COCO's tokenizer, is Java")
def test_without_java_the_python_tokenizer_gives_the_same_scores(monkeypatch):
    import mmpretrain.eval.captioning as cap

    monkeypatch.setattr(cap.shutil, "which", lambda name: None)  # a machine without java
    assert cap.default_tokenizer() == "python"
    assert caption_scores(REFS, CANDS) == pytest.approx(caption_scores(REFS, CANDS, "ptb"), abs=1e-12)
