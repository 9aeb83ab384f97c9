"""Training on NaFlex patch sequences (data.naflex, configs/tiny/naflex.yaml): every batch within the token
budget at its step's length, ranks in step, exact resume mid-epoch with mixed lengths, bad images counted,
refusals in one line, the run's Siglip2 export equal to the trained model."""

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from mmpretrain.data import naflex
from mmpretrain.data.stream import TrainStream
from mmpretrain.testing.photos import bad_huffman, make_jpegs, write_shards

from conftest import ROOT, launch, run_main, setup_run, train

CONFIG = ROOT / "configs/tiny/naflex.yaml"
LENS, BUDGET = [4, 16, 36], 144  # 36, 9 and 4 samples per rank
NF = f"data.naflex={{seq_lens: {LENS}, max_tokens_per_batch: {BUDGET}}}"


def _epoch_steps(openmoji, ranks: int) -> int:
    """Steps per epoch of the fixture's training split on ``ranks`` ranks."""
    n = sum(json.loads((openmoji / "train/sizes.json").read_text()).values())
    return naflex.steps_per_epoch(LENS, BUDGET, n, ranks)


def _jpeg(h: int, w: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=90)
    return buf.getvalue()


def test_every_batch_holds_the_budget_at_its_length_and_each_image_its_aspect(openmoji, tmp_path):
    run = setup_run(openmoji / "train", tmp_path / "run", NF, "train.steps=12", "data.num_workers=2", config=CONFIG)
    plan = run.loader.dataset.plan
    expected = plan.step_batches(0)
    assert sorted(set(expected)) == [(4, 36), (9, 16), (36, 4)]
    it = iter(run.loader)
    for n in range(9):
        b = next(it)
        size, length = expected[n]
        assert b.images.shape == (size, length, 8 * 8 * 3) and b.images.dtype == torch.uint8
        assert size * length <= BUDGET and b.patch_valid.shape == (size, length)
        assert (b.patch_valid.sum(1) >= 1).all() and b.patch_coord.shape == (size, length, 2)
        # square 32 px emoji: the largest square grid within the length (2x2, 4x4, 6x6), no padding
        side = int(length ** 0.5)
        assert b.patch_valid.all() and int(b.patch_coord[..., 0].max()) == side - 1
    x = run.images(b, torch.device("cpu"))
    assert set(x) == {"patches", "patch_coord", "patch_valid"} and x["patches"].dtype == torch.float32
    mean, std = run.images.normalize.mean.flatten(), run.images.normalize.std.flatten()
    c = b.images.reshape(*b.images.shape[:2], 64, 3)[..., 1].float() / 255  # green of every pixel
    torch.testing.assert_close(x["patches"].reshape(c.shape[0], c.shape[1], 64, 3)[..., 1], (c - mean[1]) / std[1])


def test_two_ranks_take_the_same_lengths_and_sizes_and_disjoint_samples(openmoji, tmp_path):
    """The rank's stream, as each of 2 ranks builds it (one reader each): the same (size, length) at every
    step, each sample of the epoch's used ranges once."""
    run = setup_run(openmoji / "train", tmp_path / "run", NF, "train.steps=4", "data.num_workers=0", config=CONFIG)
    from dataclasses import replace

    plan = replace(run.loader.dataset.plan, world_size=2)
    plan.__post_init__()
    decoder, tok = run.loader.dataset.decoder, run.loader.dataset.tokenizer
    per_rank = []
    for rank in (0, 1):
        stream = iter(TrainStream(plan, decoder, rank, tokenizer=tok, patch_size=8))
        per_rank.append([next(stream) for _ in range(plan.steps)])
    a, b = per_rank
    assert [x.images.shape for x in a] == [y.images.shape for y in b]
    assert [x.images.shape[:2] for x in a] == [torch.Size(s) for s in plan.step_batches(0)]
    seen = [int(i) for batches in per_rank for x in batches for i in x.sample_index]
    assert len(seen) == len(set(seen)) == 2 * plan.rank_samples
    assert plan.dropped_per_epoch == plan.num_samples - 2 * plan.rank_samples < 2 * 36


def test_a_naflex_run_resumes_bit_for_bit_mid_epoch(openmoji, tmp_path):
    args = [NF, "model.overrides={}", "train.steps=7", "train.save_every=2", "train.keep_last=9", "data.num_workers=2",
            "train.log_every=1", "data.shuffle_buffer=64"]
    run = tmp_path / "run"
    r = train(openmoji / "train", run, *args, config=CONFIG)
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines() if '"loss"' in line]
    steps = naflex.step_lengths(LENS, 0, 0, _epoch_steps(openmoji, 1))[:7]
    sizes = naflex.batch_sizes(LENS, BUDGET)
    assert [r["samples"] for r in records] == list(np.cumsum([sizes[i] for i in steps]))
    final = load_file(run / "checkpoints/step_00000007/model.safetensors")
    for k in (2, 4):  # mid-cycle and across cycles: the lengths and sizes replayed, and the samples
        other = tmp_path / f"from_{k}"
        r = train(openmoji / "train", other, *args, f"resume={run / f'checkpoints/step_0000000{k}'}", config=CONFIG)
        assert r.returncode == 0, r.stderr[-3000:]
        got = load_file(other / "checkpoints/step_00000007/model.safetensors")
        assert got.keys() == final.keys() and all(torch.equal(got[n], final[n]) for n in final), k
    # the export of the run: Siglip2 at the run's longest length, its features the trained model's
    out = tmp_path / "hf"
    r = run_main("mmpretrain.export", str(run), "--out", str(out), "--format", "transformers")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((out / "preprocessor_config.json").read_text())["max_num_patches"] == 36
    from transformers import Siglip2Model

    import mmpretrain

    ours, _, tokenizer = mmpretrain.load(run)
    hf = Siglip2Model.from_pretrained(str(out)).eval()
    imgs = [Image.open(io.BytesIO(_jpeg(h, w, i))).convert("RGB") for i, (h, w) in enumerate([(32, 32), (20, 64)])]
    per = [naflex.image_patches(im, 36, 8) for im in imgs]
    p, c, v = naflex.pack([q for q, _ in per], [g for _, g in per], 36)
    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073])
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711])
    x = naflex.normalize_patches(p, mean, std)
    tokens = tokenizer(["a red heart", "a face"])
    with torch.no_grad():
        fi = ours.encode_image({"patches": x, "patch_coord": c, "patch_valid": v}, normalize=True)
        o = hf(input_ids=tokens, pixel_values=x, pixel_attention_mask=v.long(),
               spatial_shapes=torch.tensor([g for _, g in per]))
        ft = ours.encode_text(tokens, normalize=True)
    torch.testing.assert_close(o.image_embeds, fi, atol=1e-5, rtol=0)
    torch.testing.assert_close(o.text_embeds, ft, atol=1e-5, rtol=0)
    # evaluated at several lengths, one entry each; the same length through the loaded model by hand
    results = tmp_path / "results.json"
    r = run_main("mmpretrain.eval", "--model", str(run), "--dataset", str(openmoji / "test"), "--task",
                 "zeroshot_classification", "--naflex-seq-len", "4", "36", "--num_workers", "0", "--output", str(results))
    assert r.returncode == 0, r.stderr[-3000:]
    entries = json.loads(results.read_text())["results"]
    assert [e["model"] for e in entries] == [f"{run}@4", f"{run}@36"]
    r = run_main("mmpretrain.eval", "--model", str(run), "--dataset", str(openmoji / "test"), "--task",
                 "zeroshot_classification", "--naflex-seq-len", "0")
    assert r.returncode == 2 and "positive lengths" in r.stderr


def test_bad_images_are_counted_and_odd_shapes_train(tmp_path):
    photos = make_jpegs(40, seed=3, short_side=(40, 60))
    photos[3] = (photos[3][0], bad_huffman(photos[3][1]))
    photos[5] = (photos[5][0], b"\xff\xd8 not a jpeg")
    photos[7] = (photos[7][0], _jpeg(1, 300, 7))  # a 1 x 300 strip: one row of patches
    photos[9] = (photos[9][0], _jpeg(300, 2, 9))
    photos[11] = (photos[11][0], _jpeg(3, 3, 11))  # 3 px: one patch, upsampled
    write_shards(photos, tmp_path / "data", per_shard=20)
    r = train(tmp_path / "data", tmp_path / "run", "data.naflex={seq_lens: [4, 16], max_tokens_per_batch: 64}",
              "train.epochs=1", "train.steps=null", "train.log_every=1", "data.num_workers=2", config=CONFIG)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    last = json.loads((tmp_path / "run/log.jsonl").read_text().splitlines()[-1])
    skipped = last["skipped"]
    assert sum(v for k, v in skipped.items() if k in ("undecodable_image", "truncated_jpeg")) == 2, skipped
    # two cycles of 16 + 4 = the 40 samples sizes.json counts; the 2 bad ones' slots filled (stream.py's rule)
    assert last["samples"] == 40 and last["step"] == 4
    assert skipped.get("repeated_to_fill", 0) + skipped.get("borrowed_to_fill", 0) == 2, skipped


@pytest.mark.parametrize("overrides, message", [
    (["model.arch=mmpt-tiny-vit", "train.steps=2"], "data.naflex makes patch sequences, which model.arch=mmpt-tiny-vit"),
    (["data.naflex=null", "train.steps=2"], "model.arch=mmpt-tiny-naflex is a NaFlex image tower"),
    (["data.naflex={seq_lens: [4, 64], max_tokens_per_batch: 32}"], "holds no sample of length 64"),
    (["data.naflex={seq_lens: [4, 4], max_tokens_per_batch: 32}"], "distinct positive lengths"),
    (["data.decode=device"], "set data.decode=worker"),
    (["model.patch_dropout=0.5", "train.steps=2"], "has no patch tokens to drop"),
    (["data.naflex={seq_lens: [4], max_tokens_per_batch: 100000}", "train.steps=2"],
     "lower data.naflex.max_tokens_per_batch"),
])
def test_naflex_refusals_are_one_line(openmoji, tmp_path, overrides, message):
    r = train(openmoji / "train", tmp_path / "run", *overrides, config=CONFIG)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_naflex_seq_len_on_a_square_model_is_refused(demo_run, openmoji):
    r = run_main("mmpretrain.eval", "--model", str(demo_run), "--dataset", str(openmoji / "test"), "--task",
                 "zeroshot_classification", "--naflex-seq-len", "16")
    assert r.returncode == 2 and "is not a NaFlex model" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_grad_cache_over_patch_sequences_gives_the_whole_batch_step(openmoji, tmp_path):
    """train.micro_batch_size splits each step's patches, coordinates and mask (36 -> 8 x 4 + 4, 9 -> 8 + 1)."""
    args = [NF, "train.steps=3", "data.num_workers=0", "data.shuffle_buffer=0"]
    for name, extra in (("whole", []), ("cached", ["train.micro_batch_size=8"])):
        r = train(openmoji / "train", tmp_path / name, *args, *extra, config=CONFIG)
        assert r.returncode == 0, r.stderr[-3000:]
    a = load_file(tmp_path / "whole/checkpoints/step_00000003/model.safetensors")
    b = load_file(tmp_path / "cached/checkpoints/step_00000003/model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=2e-5, rtol=1e-4, msg=k)


def test_two_gloo_ranks_train_in_step(openmoji, tmp_path):
    """2 processes: the sigmoid loss gathers every step's features, which needs the same batch size on both
    ranks at every step; the log counts both ranks' samples of each step's size."""
    run = tmp_path / "run"
    r = launch(run, openmoji / "train", "model.arch=mmpt-tiny-naflex", "model.lock_text=false",
               "model.text_from_targets=false", NF, "loss=[{name: sigmoid}]", "train.steps=5", "train.epochs=null",
               "optim.warmup_steps=1", "train.log_every=1", "data.num_workers=1")
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines() if '"loss"' in line]
    sizes = naflex.batch_sizes(LENS, BUDGET)
    assert [x["samples"] for x in records] == list(np.cumsum([2 * sizes[i] for i in naflex.step_lengths(LENS, 0, 0, _epoch_steps(openmoji, 2))[:5]]))
