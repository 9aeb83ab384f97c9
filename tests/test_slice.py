"""The whole slice on real data through the public commands: build -> embed -> train -> evaluate ->
export -> reload with open_clip and compare embeddings with the trained model."""

import json
import math
from pathlib import Path

import open_clip
import pytest
import torch

import mmpretrain

from conftest import DEMO_TOWER, ROOT, TEXT_MODEL, run_main, setup_run, train


def train_4_steps(openmoji: Path, run_dir: Path, *extra: str):
    r = train(openmoji / "train", run_dir, "train.steps=4", "data.batch_size=32", "data.num_workers=1",
              "train.log_every=2", *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def test_frozen_minilm_text_from_targets_is_exact():
    from sentence_transformers import SentenceTransformer

    from mmpretrain.models.factory import build_dual_encoder, make_tokenizer, resolve_model_cfg

    cfg = resolve_model_cfg("mmpt-tiny-vit-minilm")
    model = build_dual_encoder(cfg, lock_text=True, text_from_targets=True).eval()
    captions = ["grinning cat face with smiling eyes", "black large square", "clock face one oclock"]
    st = SentenceTransformer(TEXT_MODEL)
    t = torch.tensor(st.encode(captions, normalize_embeddings=True))
    with torch.no_grad():
        via_tower = model.clip.encode_text(make_tokenizer(cfg)(captions), normalize=True)
        via_targets = model(torch.zeros(3, 3, 32, 32), target_embeddings=t)["text_features"]
    torch.testing.assert_close(via_targets, via_tower, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ["mmpt-tiny-vit", "ViT-B-32"])
def test_trimmed_text_padding_is_the_same_function(arch):
    """The trainer drops the batch's trailing padding columns before the causal text tower: same
    features and gradients as open_clip's encode_text over the full context."""
    from mmpretrain.models.factory import build_dual_encoder, make_tokenizer, resolve_model_cfg
    from mmpretrain.models.text import encode_text_trimmed, trim_padding, trims_text

    cfg = resolve_model_cfg(arch)
    torch.manual_seed(0)
    model = build_dual_encoder(cfg, lock_text=False, text_from_targets=False).double().train()
    tokens = make_tokenizer(cfg)(["grinning cat face with smiling eyes", "black large square", "moon"])
    assert (tokens[:, 12:] == 0).all() and tokens.shape[1] >= 32  # most of the context is padding
    full = model.clip.encode_text(tokens, normalize=True)
    short = trim_padding(tokens)
    assert short.shape[1] < tokens.shape[1] and trims_text(model.clip)
    trimmed = encode_text_trimmed(model.clip, short)
    torch.testing.assert_close(trimmed, full, rtol=1e-9, atol=1e-12)
    w = model.clip.transformer.resblocks[-1].mlp.c_fc.weight
    g_full, = torch.autograd.grad((full * torch.arange(full.shape[1])).sum(), w)
    g_trim, = torch.autograd.grad((trimmed * torch.arange(full.shape[1])).sum(), w)
    torch.testing.assert_close(g_trim, g_full, rtol=1e-9, atol=1e-12)
    # bucketed to a multiple of 8 (train.text_length_multiple, for torch.compile): the same function
    bucketed = trim_padding(tokens, 8)
    assert bucketed.shape[1] % 8 == 0 and short.shape[1] <= bucketed.shape[1] < short.shape[1] + 8
    torch.testing.assert_close(encode_text_trimmed(model.clip, bucketed), full, rtol=1e-9, atol=1e-12)


def test_slice_train_eval_export_reload(openmoji, tmp_path):
    run_dir = tmp_path / "run"
    r = train_4_steps(openmoji, run_dir, "train.plots=true")  # the whole run folder, as a user gets it
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 4
    for name in ("config.yaml", "model_config.json", "provenance.json", "log.jsonl", "plots/loss.png",
                 "checkpoints/step_00000004/model.safetensors", "checkpoints/step_00000004/train_state.json"):
        assert (run_dir / name).is_file(), name
    log = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [2, 4]
    assert all(k in log[-1] for k in ("clip_loss", "soft_target_loss", "lr", "logit_scale"))
    # another config into the same folder would resume it with different training: refused before any work
    again = run_main("mmpretrain.train", "--config", str(ROOT / "configs/demo.yaml"),
                    f"data.train={openmoji / 'train'}", f"run_dir={run_dir}")
    assert again.returncode == 2 and "different config" in again.stderr and "data.batch_size" in again.stderr

    results = run_dir / "results.json"
    r = run_main("mmpretrain.eval", "--model", str(run_dir), "--dataset", str(openmoji), str(openmoji / "test"),
                "--task", "zeroshot_classification", "zeroshot_retrieval", "--output", str(results))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "x chance" in r.stdout
    entries = json.loads(results.read_text())["results"]
    assert [e["task"] for e in entries] == ["zeroshot_classification", "zeroshot_retrieval"]
    cls = entries[0]
    assert cls["dataset"] == "openmoji-test" and cls["n"] > 0
    assert {"acc1", "mean_per_class_recall"} <= set(cls["metrics"]) == set(cls["chance"])
    assert {"image_retrieval_recall@5", "text_retrieval_recall@5"} <= set(entries[1]["metrics"])

    r = run_main("mmpretrain.eval", "--model", str(run_dir), "--dataset", str(openmoji), str(openmoji),
                str(openmoji), "--task", "linear_probe", "knn", "clustering", "--output", str(results))
    assert r.returncode == 0, r.stderr[-3000:]
    probes = {e["task"]: e for e in json.loads(results.read_text())["results"][2:]}
    assert {"lp_acc1", "lp_acc1_preproj"} <= set(probes["linear_probe"]["metrics"])
    assert {"knn_acc1", "knn_acc1_preproj"} <= set(probes["knn"]["metrics"])
    assert {"ari", "silhouette_mean", "silhouette_std", "ari_preproj"} <= set(probes["clustering"]["metrics"])
    assert probes["knn"]["n"] == cls["n"]  # the labelled held-out images

    out = tmp_path / "export"
    r = run_main("mmpretrain.export", str(run_dir), "--out", str(out), "--push-to-hub", "me/demo", "--dry-run")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "would upload" in r.stdout
    card = (out / "README.md").read_text()
    assert "pipeline_tag: zero-shot-image-classification" in card and "acc1" in card
    # licence, dataset and credit from the training data's manifest (recorded in provenance.json)
    data = json.loads((run_dir / "provenance.json").read_text())["data"]
    assert [(d["source"], d["dataset"], d["license"]) for d in data] == [("demo:openmoji", "openmoji", "CC BY-SA 4.0")]
    assert "license: cc-by-sa-4.0" in card and "datasets:\n- openmoji" in card and "OpenMoji" in card

    exported, preprocess = open_clip.create_model_from_pretrained(f"local-dir:{out}")
    exported.eval()
    tokenizer = open_clip.get_tokenizer(f"local-dir:{out}")
    trained, preprocess2, tokenizer2 = mmpretrain.load(str(run_dir))
    from PIL import Image

    images = torch.stack([preprocess(Image.new("RGB", (64, 64), c)) for c in ("red", "white", "yellow")])
    texts = ["a cat", "an emoji of a heart", "clock face"]
    with torch.no_grad():
        torch.testing.assert_close(exported.encode_image(images), trained.encode_image(images))
        assert torch.equal(tokenizer(texts), tokenizer2(texts))
        torch.testing.assert_close(exported.encode_text(tokenizer(texts)), trained.encode_text(tokenizer2(texts)))
    # the export holds the trained weights, not the initialisation (the scale moved from ln(1/0.07))
    assert not torch.allclose(exported.logit_scale, torch.tensor(1 / 0.07).log())

    # transformers: the MiniLM text tower has no CLIPModel equivalent (refused, naming it); the image
    # encoder alone exports as CLIPVisionModelWithProjection with equal embeddings
    r = run_main("mmpretrain.export", str(run_dir), "--out", str(tmp_path / "hf"), "--format", "transformers")
    assert r.returncode == 2 and "all-MiniLM-L6-v2 is a Hugging Face model" in r.stderr
    r = run_main("mmpretrain.export", str(run_dir), "--out", str(tmp_path / "hf_image"), "--format", "transformers",
                "--towers", "image")
    assert r.returncode == 0, r.stderr[-3000:]
    from transformers import CLIPImageProcessor, CLIPVisionModelWithProjection

    vision = CLIPVisionModelWithProjection.from_pretrained(tmp_path / "hf_image").eval()
    processor = CLIPImageProcessor.from_pretrained(tmp_path / "hf_image")
    pil = [Image.new("RGB", (64, 48), c) for c in ("red", "white", "yellow")]
    with torch.no_grad():
        pixels = processor(images=pil, return_tensors="pt").pixel_values
        torch.testing.assert_close(pixels, torch.stack([preprocess2(p) for p in pil]), atol=2e-2, rtol=0)
        torch.testing.assert_close(vision(pixel_values=images).image_embeds, trained.encode_image(images),
                                   atol=1e-4, rtol=1e-4)


def test_slice_trainable_open_clip_text_tower(openmoji, tmp_path):
    run_dir = tmp_path / "run_text"
    # targets computed online by the frozen encoder instead of read from the shards
    train_4_steps(openmoji, run_dir, *DEMO_TOWER, "model.arch=mmpt-tiny-vit", "model.lock_text=false", "model.text_from_targets=false",
          "targets.source=online")
    assert "targets: online" in (run_dir / "config.yaml").read_text()
    model, preprocess, tokenizer = mmpretrain.load(str(run_dir))
    assert isinstance(model, open_clip.CLIP)
    assert model.encode_text(tokenizer(["a cat"])).shape == (1, 256)

    # transformers export: CLIPModel + CLIPProcessor, equal embeddings from the folder alone
    out = tmp_path / "hf"
    r = run_main("mmpretrain.export", str(run_dir), "--out", str(out), "--format", "transformers")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "library_name: transformers" in (out / "README.md").read_text()
    from PIL import Image
    from transformers import CLIPModel, CLIPProcessor

    hf = CLIPModel.from_pretrained(out).eval()
    processor = CLIPProcessor.from_pretrained(out)
    texts = ["grinning face with smiling eyes", "black large square", "clock face one oclock"]
    images = torch.stack([preprocess(Image.new("RGB", (40, 40), c)) for c in ("red", "white", "blue")])
    with torch.no_grad():
        ids = processor(text=texts, padding="max_length", return_tensors="pt").input_ids
        ours_t = model.encode_text(tokenizer(texts))
        theirs_t = hf.get_text_features(input_ids=ids)
        theirs_i = hf.get_image_features(pixel_values=images)
        theirs_t = getattr(theirs_t, "pooler_output", theirs_t)
        theirs_i = getattr(theirs_i, "pooler_output", theirs_i)
        torch.testing.assert_close(theirs_t, ours_t, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(theirs_i, model.encode_image(images), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(hf.logit_scale, model.logit_scale)


def test_slice_two_cpu_ranks_under_accelerate(openmoji, ddp_checks, tmp_path):
    """A run trained by 2 processes under accelerate launch, then evaluated under the same launcher (both
    in the ``ddp_checks`` fixture's launch): split across the 2 processes, written once, equal to one
    process."""
    from conftest import DDP_EVAL

    run_dir = ddp_checks["run_dir"]
    cfg = (run_dir / "config.yaml").read_text()
    assert "world_size: 2" in cfg and "global_batch_size: 32" in cfg
    out1 = tmp_path / "one.json"
    r = run_main("mmpretrain.eval", "--model", str(run_dir), *(a.format(data=openmoji) for a in DDP_EVAL),
                 "--output", str(out1))
    assert r.returncode == 0, r.stderr[-3000:]
    printed = ddp_checks["stdout"]
    assert printed.count("zeroshot_classification") >= 1 and printed.count("x chance") == 1  # one table
    one, two = (json.loads(p.read_text())["results"] for p in (out1, ddp_checks["eval_output"]))
    assert [e["n"] for e in one] == [e["n"] for e in two]
    for a, b in zip(one, two):
        assert b["metrics"] == pytest.approx(a["metrics"], rel=1e-4, abs=1e-5)  # float32 features, other batches


TERMS = {"demo_sigmoid.yaml": ("sigmoid_loss", "vrn_loss"), "demo_cwcl.yaml": ("cwcl_loss", "align_uniform_loss"),
         "tiny/clip.yaml": ("clip_loss",), "tiny/sigmoid.yaml": ("sigmoid_loss",),
         "tiny/soft_target.yaml": ("clip_loss", "soft_target_loss"), "tiny/finetune_lora.yaml": ("clip_loss",)}


def test_shipped_cpu_configs_run_steps(openmoji, tmp_path):
    """Every CPU-sized config runs 2 steps on the real data (in one process, one after another)."""
    from mmpretrain.train import fit

    for config, terms in TERMS.items():
        run_dir = tmp_path / config.replace("/", "_").removesuffix(".yaml")
        fit(setup_run(openmoji / "train", run_dir, "train.steps=2", "data.batch_size=16", "data.num_workers=0",
                      "train.log_every=1", config=ROOT / "configs" / config))
        last = json.loads((run_dir / "log.jsonl").read_text().splitlines()[-1])
        assert all(k in last and math.isfinite(last[k]) for k in terms), config
        if "sigmoid" in config:
            model, _, _ = mmpretrain.load(str(run_dir))
            assert model.logit_bias is not None  # the sigmoid term's declared bias was applied


def test_export_licence_comes_from_the_training_data():
    from mmpretrain.export.card import license_for

    assert license_for([]) == license_for([{"license": None}]) == "apache-2.0"  # none recorded: the code's
    assert license_for([{"license": "CC BY-SA 4.0"}, {"license": "CC BY-SA 4.0"}]) == "cc-by-sa-4.0"
    assert license_for([{"license": "CC BY-SA 4.0"}, {"license": "CC BY 4.0"}]) == "other"  # the card lists both
    assert license_for([{"license": "custom terms"}]) == "other"
