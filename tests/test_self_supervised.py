"""SigLIP 2's self-supervised terms (self_distill: SILC; masked_prediction: TIPS): value, gradient and centre
against naive float64 code on 1 and 2 gloo ranks; the start step; the student's and teacher's forwards against
open_clip's tower; the seeded local crops and masks; a tiny run from the CLI that resumes bit for bit on
either side of the start step and exports; 2 processes under DDP; the refusals."""

from __future__ import annotations

import copy
import json
import tarfile

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from mmpretrain.losses import build_objective, total_of
from mmpretrain.models import factory
from mmpretrain.models.factory import pre_projection
from mmpretrain.models.patch_dropout import kept_patches
from mmpretrain.models.positions import fit_positions
from mmpretrain.models.ssl import masked_patches, tower

from conftest import ROOT, run_main, train
from ddp_helpers import run_ranks

CONFIG = ROOT / "configs/tiny/siglip2.yaml"
TS, TT, M = 0.1, 0.04, 0.9  # the terms' default temperatures and centre momentum


def naive(student, teacher, centre):
    """DINO's loss, a row at a time: -sum_k softmax((t - c) / tt)_k log softmax(s / ts)_k, averaged."""
    total, rows = 0.0, 0
    for i in range(student.shape[0]):
        for v in range(student.shape[1]):
            t = teacher[i] if teacher.dim() == 2 else teacher[i, v]
            p = torch.exp((t - centre) / TT) / torch.exp((t - centre) / TT).sum()
            logq = student[i, v] / TS - torch.log(torch.exp(student[i, v] / TS).sum())
            total = total - (p * logq).sum()
            rows += 1
    return total / rows


def _cases(seed, b=6, k=11):
    g = torch.Generator().manual_seed(seed)
    return {
        "self_distill": (torch.randn(b, 3, k, generator=g, dtype=torch.float64),
                         torch.randn(b, k, generator=g, dtype=torch.float64)),
        "masked_prediction": (torch.randn(b, 5, k, generator=g, dtype=torch.float64),
                              torch.randn(b, 5, k, generator=g, dtype=torch.float64)),
    }


KEYS = {"self_distill": ("student_local", "teacher_global"), "masked_prediction": ("student_masked", "teacher_masked")}


@pytest.mark.parametrize("name", ["self_distill", "masked_prediction"])
def test_value_gradient_and_centre_equal_naive_float64(name):
    student, teacher = _cases(0)[name]
    objective = build_objective([{"name": name, "options": {"out_dim": 11, "start_at": 0}}]).double()
    term = objective.terms[0]
    centre = torch.randn(11, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    term.centre.copy_(centre)
    s = student.clone().requires_grad_()
    out = objective(**{KEYS[name][0]: s, KEYS[name][1]: teacher}, step=0)
    ref_s = student.clone().requires_grad_()
    ref = naive(ref_s, teacher, centre)
    torch.testing.assert_close(out[f"{name}_loss"], ref, rtol=1e-12, atol=1e-12)
    assert ref.item() > 1  # ~ln(11) at random logits: not a constant
    total_of(out).backward()
    ref.backward()
    torch.testing.assert_close(s.grad, ref_s.grad, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(term.centre, centre)  # unchanged until the step is accepted
    objective.commit_step()
    rows = teacher if teacher.dim() == 3 else teacher[:, None].expand_as(student)
    torch.testing.assert_close(term.centre, M * centre + (1 - M) * rows.reshape(-1, 11).mean(0), rtol=1e-12, atol=1e-12)
    objective(**{KEYS[name][0]: s, KEYS[name][1]: teacher}, step=0)
    before = term.centre.clone()
    objective.commit_step(torch.tensor(False))  # a skipped step (decided on the device) moves nothing
    torch.testing.assert_close(term.centre, before, rtol=0, atol=0)


def _rank_terms(rank, world):
    out = {}
    for name, (student, teacher) in _cases(1).items():
        half = slice(rank * 3, rank * 3 + 3)
        objective = build_objective([{"name": name, "options": {"out_dim": 11, "start_at": 0}}],
                                    rank=rank, world_size=world).double()
        s = student[half].clone().requires_grad_()
        loss = total_of(objective(**{KEYS[name][0]: s, KEYS[name][1]: teacher[half]}, step=0))
        loss.backward()
        objective.commit_step()
        out[name] = (loss.detach(), s.grad, objective.terms[0].centre.clone())
    return out


def test_two_gloo_ranks_take_their_rows_and_share_one_centre(tmp_path):
    results = run_ranks(_rank_terms, (), tmp_path)
    for name, (student, teacher) in _cases(1).items():
        rows = teacher if teacher.dim() == 3 else teacher[:, None].expand_as(student)
        want_centre = (1 - M) * rows.reshape(-1, 11).mean(0)  # over both ranks' rows
        for rank, res in enumerate(results):
            loss, grad, centre = res[name]
            half = slice(rank * 3, rank * 3 + 3)
            s = student[half].clone().requires_grad_()
            ref = naive(s, teacher[half], torch.zeros(11, dtype=torch.float64))
            ref.backward()
            torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(grad, s.grad, rtol=1e-10, atol=1e-14)
            torch.testing.assert_close(centre, want_centre, rtol=1e-12, atol=1e-12)


def test_the_start_step_as_a_share_or_a_step():
    objective = build_objective([{"name": "self_distill", "options": {"out_dim": 11}},
                                 {"name": "masked_prediction", "options": {"out_dim": 11, "start_at": 30}}])
    objective.for_schedule(100)
    assert [t.start_step for t in objective.terms] == [80, 30]
    assert objective.ssl_active(29) == frozenset() and objective.ssl_active(30) == {"masked_prediction"}
    assert objective.ssl_active(80) == {"self_distill", "masked_prediction"}
    out = objective(step=10)  # before both: zeros, and nothing proposed
    assert out["self_distill_loss"].item() == 0 and out["masked_prediction_loss"].item() == 0
    objective.commit_step()
    assert all(t.centre.abs().sum() == 0 for t in objective.terms)
    with pytest.raises(ValueError, match="masked_prediction at step 40 .* needs student_masked"):
        objective(step=40)


@pytest.mark.parametrize("options, says", [
    ({"start_at": 1.0}, "start_at must be a share"), ({"start_at": -1}, "start_at must be"),
    ({"teacher_temp": 0}, "teacher_temp must be > 0"), ({"local_scale": [0.5, 0.1]}, "local_scale must be"),
    ({"local_crops": 0}, "local_crops must be a whole number"), ({"centre_momentum": 1}, "centre_momentum"),
])
def test_bad_options_name_themselves(options, says):
    with pytest.raises(ValueError, match=says):
        build_objective([{"name": "self_distill", "options": options}])


def _vit(seed=0):
    torch.manual_seed(seed)
    factory.register_packaged_configs()
    clip = factory.instantiate(factory.resolve_model_cfg("mmpt-tiny-vit"), load_text_weights=False).double().eval()
    return clip.visual


def test_the_tower_is_open_clips_and_fits_its_positions_to_a_smaller_crop():
    visual = _vit()
    x = torch.randn(3, 3, 32, 32, dtype=torch.float64)
    pooled, tokens = tower(visual, x)
    torch.testing.assert_close(pooled, pre_projection(visual, x), rtol=1e-12, atol=1e-12)
    visual.output_tokens = True
    _, ref_tokens = visual(x)
    visual.output_tokens = False
    torch.testing.assert_close(tokens, ref_tokens, rtol=1e-12, atol=1e-12)
    # a 16 px crop: 2 x 2 patches, the table resized by open_clip's rule in fp32 (a copy of the tower built for it)
    small = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    ref = copy.deepcopy(visual)
    ref.positional_embedding = torch.nn.Parameter(fit_positions(visual.positional_embedding.detach(), 5))
    got, _ = tower(visual, small)
    torch.testing.assert_close(got, pre_projection(ref, small), rtol=1e-12, atol=1e-12)
    got.sum().backward()  # the gradient reaches the full table through the resize
    assert visual.positional_embedding.grad.abs().sum() > 0


def test_the_mask_token_replaces_the_masked_patch_embeddings_only():
    visual = _vit()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    index = torch.tensor([[0, 5, 9], [1, 2, 15]])
    embedded = visual.conv1(x).flatten(2).transpose(1, 2)
    # the token equal to a sample's own embedding there: the unmasked output
    same, _ = tower(visual, x[:1], index[:1, :1], embedded[0, 0])
    torch.testing.assert_close(same, tower(visual, x[:1])[0], rtol=1e-12, atol=1e-12)
    # naive: the embeddings replaced by hand, then open_clip's own layers
    token = torch.randn(visual.transformer.width, dtype=torch.float64)
    _, got = tower(visual, x, index, token)
    e = embedded.clone()
    for i in range(2):
        for j in index[i]:
            e[i, j] = token
    h = torch.cat([visual.class_embedding.expand(2, 1, -1), e], 1) + visual.positional_embedding
    h = visual.transformer(visual.ln_pre(h))
    want = visual.ln_post(h)[:, 1:]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_masks_are_seeded_per_sample_and_step_and_not_patch_dropouts():
    idx = torch.tensor([3, 7, 7, 1000])
    a = masked_patches(idx, 0, 5, 16, 8)
    assert a.shape == (4, 8) and torch.equal(a, masked_patches(idx, 0, 5, 16, 8))
    assert all(len(set(r.tolist())) == 8 and r.tolist() == sorted(r.tolist()) for r in a)
    assert torch.equal(a[1], a[2]) and not torch.equal(a[0], a[1])  # the sample's index, not its slot
    assert not torch.equal(a, masked_patches(idx, 0, 6, 16, 8)) and not torch.equal(a, masked_patches(idx, 1, 5, 16, 8))
    assert not torch.equal(a, kept_patches(idx, 0, 5, 16, 0.5))
    # every patch about equally often over many draws
    counts = np.bincount(masked_patches(torch.arange(4000), 0, 1, 16, 8).flatten().numpy(), minlength=16)
    assert counts.min() > 0.9 * 2000 and counts.max() < 1.1 * 2000


def test_local_crops_are_cut_from_the_stored_sample_seeded(openmoji):
    import io

    from PIL import Image

    from mmpretrain.data.crop import ResizedCrop
    from mmpretrain.data.decode import SampleDecoder, SkipSample, augmentation_seed
    from mmpretrain.losses.self_supervised import LocalCrops

    shard = sorted((openmoji / "train").glob("*.tar"))[0]
    with tarfile.open(shard) as tf:
        members = {m.name: tf.extractfile(m).read() for m in tf.getmembers() if m.isfile()}
    key = sorted({n.split(".")[0] for n in members})[0]
    raw = {"__key__": key, **{n.split(".", 1)[1]: v for n, v in members.items() if n.split(".")[0] == key}}
    local = LocalCrops(3, 16, (0.05, 0.4))
    decoder = SampleDecoder(ResizedCrop(32), local_crops=local)
    item = decoder(raw, seed=0, epoch=0)
    crops = item["local"]
    assert crops.shape == (3, 16, 16, 3) and crops.dtype == torch.uint8
    assert torch.equal(crops, decoder(raw, seed=0, epoch=0)["local"])  # resume: the same crops
    assert not torch.equal(crops, decoder(raw, seed=0, epoch=1)["local"])  # each epoch its own
    ext = next(e for e in ("png", "jpg", "webp") if e in raw)
    ref = ResizedCrop(16, (0.05, 0.4))
    for i in range(3):
        want = ref(Image.open(io.BytesIO(raw[ext])), augmentation_seed(0, 0, f"{key}/local{i}"))
        assert torch.equal(crops[i], want)
    bad = {**raw, ext: raw[ext][:40]}
    with pytest.raises(SkipSample):
        decoder(bad, seed=0, epoch=0)
    # a photo JPEG: one decode, at the reduction the smallest box allows, for every crop; each close to its own
    # decode (the DCT-reduced pixels differ by rounding)
    from mmpretrain.testing.photos import make_jpegs

    key, data = make_jpegs(1, short_side=(480, 480))[0]
    photo = {"__key__": key, "jpg": data, "txt": b"a photo"}
    big = SampleDecoder(ResizedCrop(224), local_crops=LocalCrops(4, 96, (0.05, 0.4)))
    crops = big(photo, seed=0, epoch=0)["local"]
    ref = ResizedCrop(96, (0.05, 0.4))
    for i in range(4):
        want = ref(Image.open(io.BytesIO(data)), augmentation_seed(0, 0, f"{key}/local{i}"))
        assert (crops[i].float() - want.float()).abs().mean() < 6, i


def _state(run, step):
    ckpt = run / f"checkpoints/step_{step:08d}"
    return load_file(ckpt / "model.safetensors"), load_file(ckpt / "ema.safetensors"), load_file(ckpt / "objective.safetensors")


SHORT_SSL = ["model.arch=mmpt-tiny-vit", "train.steps=10", "train.epochs=null", "optim.warmup_steps=2", "train.save_every=2", "train.keep_last=10",
             "model.overrides={embed_dim: 64, vision_cfg: {width: 64, layers: 2, head_width: 32}}",
             "train.ema={decay: 0.9, warmup_steps: 5}", "data.num_workers=1",
             "loss=[{name: sigmoid}, {name: self_distill, options: {start_at: 5, out_dim: 32, hidden_dim: 64, "
             "bottleneck_dim: 16, local_crops: 2, local_size: 16}}, {name: masked_prediction, weight: 0.25, "
             "options: {start_at: 0.5, out_dim: 32, hidden_dim: 64, bottleneck_dim: 16}}]"]


def test_a_run_starts_the_terms_resumes_bit_for_bit_on_either_side_and_exports(openmoji, tmp_path):
    data = openmoji / "train"
    run = tmp_path / "run"
    r = train(data, run, *SHORT_SSL, "train.log_every=1", config=CONFIG)
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    sd = {x["step"]: x["self_distill_unweighted"] for x in records if "self_distill_unweighted" in x}
    mp = {x["step"]: x["masked_prediction_unweighted"] for x in records if "masked_prediction_unweighted" in x}
    assert all(sd[s] == 0 and mp[s] == 0 for s in range(1, 6)) and all(sd[s] > 0 and mp[s] > 0 for s in range(6, 11))
    assert "note: self_distill at step 5, masked_prediction at step 5 of 10 (start_at)" in r.stderr
    w10, a10, o10 = _state(run, 10)
    assert any(k.startswith("ssl.heads.global.") for k in a10) and "ssl.mask_token" in a10  # averaged with the towers
    assert o10["terms.1.centre"].abs().sum() > 0 and o10["terms.2.centre"].abs().sum() > 0
    for start in (4, 6):  # before the start step (5) and after it
        resumed = tmp_path / f"resumed{start}"
        r = train(data, resumed, *SHORT_SSL, "train.log_every=1", f"resume={run / f'checkpoints/step_{start:08d}'}",
                  config=CONFIG)
        assert r.returncode == 0, r.stderr[-3000:]
        for ours, theirs in zip(_state(resumed, 10), (w10, a10, o10)):
            assert ours.keys() == theirs.keys()
            assert all(torch.equal(ours[k], theirs[k]) for k in theirs), start
    for extra in ([], ["--ema"]):  # the heads are the training's, not the model's: neither export has them
        out = tmp_path / f"export{len(extra)}"
        r = run_main("mmpretrain.export", str(run), "--out", str(out), *extra)
        assert r.returncode == 0, r.stderr[-3000:]
        weights = load_file(out / "open_clip_model.safetensors")
        assert not any("ssl" in k for k in weights) and "visual.conv1.weight" in weights


@pytest.mark.parametrize("overrides, says", [
    (["train.ema=null"], "the teacher is the train.ema weight average: set train.ema"),
    (["train.micro_batch_size=16"], "use train.micro_batch_mode=accumulate"),
    (["loss=[{name: sigmoid}, {name: self_distill, options: {local_size: 12}}]"],
     "local_size=12 is not a whole number of the tower's 8-pixel patches: use 8"),
    (["loss=[{name: sigmoid}, {name: self_distill, options: {start_at: 0.8, lcal_crops: 2}}]"],
     "bad options for objective 'self_distill'"),
    (["loss=[{name: self_distill}]"], "trains beside a contrastive term, as SigLIP 2 does: add {name: sigmoid}"),
    (["loss=[{name: sigmoid}, {name: self_distill, options: {start_at: 5}}]"],
     "options.start_at=5 starts it at step 5, past the run's 2 steps, so it would never run"),
])
def test_refusals_name_the_setting(openmoji, tmp_path, overrides, says):
    r = run_main("mmpretrain.train", "--config", str(CONFIG), f"data.train={openmoji / 'train'}",
                 f"run_dir={tmp_path / 'run'}", "train.steps=2", "train.epochs=null", "optim.warmup_steps=1", *overrides)
    assert r.returncode != 0 and says in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("engine", ["FSDP", "DEEPSPEED"])
def test_sharded_engines_are_refused_in_one_line(engine):
    from mmpretrain.config import ConfigError, load_config
    from mmpretrain.train.ssl_setup import attach_self_supervised

    cfg = load_config(CONFIG, ["data.train=unused"])
    objective = build_objective([t.model_dump() for t in cfg.loss])
    module = factory.build_dual_encoder(factory.resolve_model_cfg("mmpt-tiny-vit"))
    with pytest.raises(ConfigError, match=f"under {engine}: the teacher is the train.ema average"):
        attach_self_supervised(cfg, objective, module, engine)


def test_two_processes_under_ddp_train_the_heads(openmoji, tmp_path):
    """DDP over 2 gloo processes as a user launches it: the heads get a gradient (of 0) before the start step,
    so the reducer never stops on them, and are trained after it."""
    from conftest import launch

    run = tmp_path / "run"
    ssl = [o for o in SHORT_SSL if not o.startswith(("data.num_workers", "model.arch"))]  # the demo's own tower
    r = launch(run, openmoji / "train", *ssl, "train.steps=8", "train.log_every=1", "data.batch_size=16")
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in records if "loss" in x] == list(range(1, 9))
    assert records[-1]["self_distill_unweighted"] > 0
    w2, w8 = (load_file(run / f"checkpoints/step_{s:08d}/model.safetensors") for s in (2, 8))
    assert not torch.equal(w2["ssl.heads.global.prototypes"], w8["ssl.heads.global.prototypes"])


def test_accumulated_micro_batches_equal_the_whole_batch():
    """train.micro_batch_mode=accumulate: each micro-batch its rows of the local crops, mask and teacher outputs;
    the gradients and the centres equal the whole batch's (the terms alone: a contrastive term's negatives
    are the micro-batch's in this mode)."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from mmpretrain.models.ssl import SelfSupervised, SslInputs
    from mmpretrain.train.grad_cache import forward_backward

    torch.manual_seed(0)
    factory.register_packaged_configs()
    cfg = factory.with_logit_init(factory.resolve_model_cfg("mmpt-tiny-vit", overrides={
        "embed_dim": 32, "vision_cfg": {"width": 64, "layers": 1, "head_width": 32},
        "text_cfg": {"width": 32, "layers": 1, "heads": 2}}), 2.3, -10.0)
    model = factory.DualEncoder(factory.instantiate(cfg, load_text_weights=False)).double()
    terms = [{"name": "self_distill", "options": {"out_dim": 16, "hidden_dim": 32,
                                                                          "bottleneck_dim": 8, "start_at": 0,
                                                                          "local_crops": 2, "local_size": 16}},
             {"name": "masked_prediction", "weight": 0.25, "options": {"out_dim": 16, "hidden_dim": 32,
                                                                        "bottleneck_dim": 8, "start_at": 0}}]
    g = torch.Generator().manual_seed(1)
    images = torch.randn(8, 3, 32, 32, generator=g, dtype=torch.float64)
    tokens = torch.randint(1, 400, (8, 12), generator=g)
    ssl = SslInputs(torch.randn(16, 3, 16, 16, generator=g, dtype=torch.float64), 2,
                    masked_patches(torch.arange(8), 0, 0, 16, 8))
    context = {"step": 0, "teacher_global": torch.randn(8, 16, generator=g, dtype=torch.float64),
               "teacher_masked": torch.randn(8, 8, 16, generator=g, dtype=torch.float64)}
    acc = SimpleNamespace(autocast=nullcontext, backward=lambda x: x.backward(), no_sync=lambda m: nullcontext())
    results = []
    for micro in (None, 4):
        objective = build_objective(terms).double().for_tower(16)
        model.ssl = None
        torch.manual_seed(2)
        model.ssl = SelfSupervised(model.clip.visual, objective.ssl_heads).double()
        model.zero_grad(set_to_none=True)
        res = forward_backward(acc, model, objective, images, tokens, micro_batch=micro, mode="accumulate",
                               context=context, ssl=ssl)
        objective.commit_step()
        results.append((res.loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
                        [t.centre.clone() for t in objective.terms]))
    (loss_a, grads_a, centres_a), (loss_b, grads_b, centres_b) = results
    assert loss_a.item() > 0 and "ssl.heads.patch.prototypes" in grads_a and "ssl.mask_token" in grads_a
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-10, atol=1e-12)
    assert grads_a.keys() == grads_b.keys()
    for n in grads_a:
        atol = 1e-6 if n.endswith("positional_embedding") else 1e-11  # the table's resize runs in fp32
        assert torch.allclose(grads_b[n], grads_a[n], rtol=1e-8, atol=atol), (n, (grads_b[n] - grads_a[n]).abs().max())
    for a, b in zip(centres_a, centres_b):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-14)


def test_the_shipped_tiny_config_trains_sigmoid_caption_and_both_terms(openmoji, tmp_path):
    """configs/tiny/siglip2.yaml as shipped (SigLIP 2's loss set on the tiny CoCa: the terms read the
    transformer's patch tokens under the attentional pooler), its terms from 80 % of a short run."""
    run = tmp_path / "run"
    r = train(openmoji / "train", run, "train.steps=5", "train.log_every=1", "data.num_workers=1",
              "train.ema={decay: 0.9, warmup_steps: 4}", config=CONFIG)
    assert r.returncode == 0, r.stderr[-3000:]
    last = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()][-1]
    assert last["step"] == 5 and all(last[f"{k}_unweighted"] > 0 for k in
                                     ("sigmoid", "caption", "self_distill", "masked_prediction"))
