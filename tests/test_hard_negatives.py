"""Hard-negative captions (NegCLIP) on clip and sigmoid: value and gradient against naive float64 code
written from the formulas in docs/methods.md, whole and tiled, local_loss, and 2 gloo ranks equal to
one process. Plus the data side: negatives drawn per epoch, malformed ones a counted skip."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from mmpretrain.losses import LOSSES

from ddp_helpers import run_ranks

B, D = 10, 16
TOL = dict(rtol=1e-6, atol=1e-8)
MASK = torch.tensor([1, 0, 1, 1, 0, 1, 1, 1, 0, 1], dtype=torch.bool)  # 3 samples without a negative


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y, n = (F.normalize(torch.randn(B, D, generator=g, dtype=torch.float64), dim=-1).requires_grad_()
               for _ in range(3))
    s = torch.tensor(7.5, dtype=torch.float64, requires_grad=True)
    bias = torch.tensor(-3.0, dtype=torch.float64, requires_grad=True)
    return x, y, n, s, bias


def naive_negclip(x, y, n, mask, s):
    """NegCLIP: image i's softmax over every caption and every sample's negative (those that exist);
    caption j's softmax over the images. Row by row, from the definition."""
    valid = [j for j in range(B) if mask[j]]
    total_i = total_t = 0.0
    for i in range(B):
        cols = torch.stack([s * x[i] @ y[j] for j in range(B)] + [s * x[i] @ n[j] for j in valid])
        total_i = total_i - (cols[i] - torch.logsumexp(cols, 0))
        rows = torch.stack([s * y[i] @ x[j] for j in range(B)])
        total_t = total_t - (rows[i] - torch.logsumexp(rows, 0))
    return 0.5 * (total_i + total_t) / B


def naive_sigmoid_negatives(x, y, n, mask, s, b):
    """SigLIP's pairs plus one negative pair per (image, existing negative caption), over the batch."""
    total = 0.0
    for i in range(B):
        for j in range(B):
            z = 1.0 if i == j else -1.0
            total = total - F.logsigmoid(z * (s * x[i] @ y[j] + b))
            if mask[j]:
                total = total - F.logsigmoid(-(s * x[i] @ n[j] + b))
    return total / B


def _objective(name, **options):
    return LOSSES[name](hard_negatives=True, **options)


def _run(obj, x, y, n, s, bias, mask=MASK):
    out = obj(image_features=x, text_features=y, logit_scale=s, logit_bias=bias, negative_text_features=n,
              negative_mask=mask)
    return out[f"{obj.name}_loss"]


CASES = [("clip", {}), ("clip", {"chunk_size": 3}), ("clip", {"local_loss": True}),
         ("clip", {"local_loss": True, "chunk_size": 4}), ("sigmoid", {}), ("sigmoid", {"chunk_size": 3})]


@pytest.mark.parametrize("name,options", CASES, ids=[f"{n}-{o}" for n, o in CASES])
def test_value_and_gradient_equal_naive(name, options):
    x, y, n, s, bias = inputs()
    ref = naive_negclip(x, y, n, MASK, s) if name == "clip" else naive_sigmoid_negatives(x, y, n, MASK, s, bias)
    ours = _run(_objective(name, **options), x, y, n, s, bias)
    torch.testing.assert_close(ours, ref, **TOL)
    wrt = (x, y, n, s) + ((bias,) if name == "sigmoid" else ())
    for g_ours, g_ref in zip(torch.autograd.grad(ours, wrt), torch.autograd.grad(ref, wrt)):
        torch.testing.assert_close(g_ours, g_ref, **TOL)


def test_no_negative_anywhere_is_the_plain_objective():
    """A batch whose samples have no negatives trains as before, in value and gradient."""
    x, y, n, s, bias = inputs(1)
    none = torch.zeros(B, dtype=torch.bool)
    for name in ("clip", "sigmoid"):
        plain = LOSSES[name]()(image_features=x, text_features=y, logit_scale=s, logit_bias=bias)[f"{name}_loss"]
        ours = _run(_objective(name), x, y, n, s, bias, mask=none)
        torch.testing.assert_close(ours, plain, rtol=0, atol=0)
        assert not torch.autograd.grad(ours, n, allow_unused=True, materialize_grads=True)[0].any()


def test_negatives_raise_the_loss_and_get_a_gradient_away():
    """The negatives are columns the images must beat: the loss rises; only existing negatives get a
    gradient, and moving every negative along its gradient (towards the images) raises the loss."""
    x, y, n, s, bias = inputs(2)
    plain = LOSSES["clip"]()(image_features=x, text_features=y, logit_scale=s)["clip_loss"]
    ours = _run(_objective("clip"), x, y, n, s, bias)
    assert ours > plain
    (gn,) = torch.autograd.grad(ours, n)
    assert gn[MASK].norm(dim=1).gt(0).all() and not gn[~MASK].any()
    moved = _run(_objective("clip"), x, y, F.normalize(n + 0.05 * gn / gn.norm(), dim=-1), s, bias)
    assert moved > ours


def test_missing_inputs_and_bad_option_are_refused():
    x, y, n, s, bias = inputs()
    with pytest.raises(ValueError, match="needs negative_text_features"):
        _objective("clip")(image_features=x, text_features=y, logit_scale=s)
    with pytest.raises(ValueError, match="hard_negatives must be true or false"):
        LOSSES["clip"](hard_negatives="yes")
    with pytest.raises(ValueError, match="not offered inside the region wrapper"):
        LOSSES["regions"](base="clip", base_options={"hard_negatives": True})
    assert _objective("clip").largest_matrix(B) == B * 2 * B
    assert _objective("clip", chunk_size=4).largest_matrix(B) == 16


def _rank_case(rank, world, name, options):
    x, y, n, s, bias = inputs(3)
    per = B // world
    sl = slice(rank * per, (rank + 1) * per)
    xs, ys, ns = (t.detach()[sl].clone().requires_grad_() for t in (x, y, n))
    sr, br = s.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
    obj = _objective(name, rank=rank, world_size=world, **options)
    loss = _run(obj, xs, ys, ns, sr, br, mask=MASK[sl])
    loss.backward()
    return loss.detach(), xs.grad, ys.grad, ns.grad, sr.grad, br.grad


RANK_CASES = [("clip", {}), ("clip", {"chunk_size": 3}), ("clip", {"local_loss": True}),
              ("clip", {"gather_with_grad": False}), ("sigmoid", {}), ("sigmoid", {"chunk_size": 2})]


@pytest.mark.parametrize("name,options", RANK_CASES, ids=[f"{n}-{o}" for n, o in RANK_CASES])
def test_two_ranks_equal_one_process(name, options, tmp_path):
    x, y, n, s, bias = inputs(3)
    full = _run(_objective(name), x, y, n, s, bias)
    wrt = (x, y, n, s, bias) if name == "sigmoid" else (x, y, n, s)
    g_full = torch.autograd.grad(full, wrt)
    res = run_ranks(_rank_case, (name, options), tmp_path, world=2)
    # the mean over ranks is one process's loss; DDP averages parameter gradients: rank r's feature
    # gradient / world is the one-process gradient of its slice
    torch.testing.assert_close(torch.stack([r[0] for r in res]).mean(), full, **TOL)
    for k in range(3):
        torch.testing.assert_close(torch.cat([r[1 + k] for r in res]) / 2, g_full[k], **TOL)
    torch.testing.assert_close(torch.stack([r[4] for r in res]).mean(), g_full[3], **TOL)
    if name == "sigmoid":
        torch.testing.assert_close(torch.stack([r[5] for r in res]).mean(), g_full[4], **TOL)


# ---- the data side: the decoder draws one negative per epoch; a malformed list is a counted skip ----

def _raw(key, meta):
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), "red").save(buf, "PNG")
    return {"__key__": key, "png": buf.getvalue(), "txt": b"a red square", "json": json.dumps(meta).encode()}


def test_decoder_draws_a_negative_per_epoch_and_skips_malformed_lists():
    from mmpretrain.data.decode import SampleDecoder, SkipSample

    dec = SampleDecoder(lambda im: torch.zeros(3, 4, 4), needs={"negatives"})
    negs = ["a blue square", "a red circle", "a green square"]
    drawn = {dec(_raw("k1", {"negative_captions": negs}), seed=0, epoch=e)["negative"] for e in range(12)}
    assert drawn <= set(negs) and len(drawn) > 1  # one of them each epoch, not always the same
    again = dec(_raw("k1", {"negative_captions": negs}), seed=0, epoch=3)["negative"]
    assert again == dec(_raw("k1", {"negative_captions": negs}), seed=0, epoch=3)["negative"]  # seeded
    assert dec(_raw("k2", {}), seed=0, epoch=0)["negative"] is None  # none: trained as before
    assert dec(_raw("k2", {"negative_captions": []}), seed=0, epoch=0)["negative"] is None
    for bad in ("not a list", [1, 2], ["ok", ""], {"a": 1}):
        with pytest.raises(SkipSample) as e:
            dec(_raw("k3", {"negative_captions": bad}), seed=0, epoch=0)
        assert e.value.reason == "bad_negative_captions"
    plain = SampleDecoder(lambda im: torch.zeros(3, 4, 4))  # the option off: the field is not read
    assert "negative" not in plain(_raw("k3", {"negative_captions": "not a list"}), seed=0, epoch=0)


def test_grad_cache_with_negatives_equals_the_whole_batch():
    """The negatives' features are cached and re-forwarded like the captions': the parameter gradient of
    a grad-cached step equals the whole batch's."""
    from accelerate import Accelerator

    from mmpretrain.losses import build_objective
    from mmpretrain.models.factory import build_dual_encoder, resolve_model_cfg
    from mmpretrain.train.grad_cache import forward_backward

    torch.manual_seed(0)
    cfg = resolve_model_cfg("mmpt-tiny-vit", None, {"vision_cfg": {"layers": 2}, "text_cfg": {"layers": 2}})
    model = build_dual_encoder(cfg, lock_text=False, text_from_targets=False).double().train()
    objective = build_objective([{"name": "clip", "options": {"hard_negatives": True}}])
    g = torch.Generator().manual_seed(1)
    images = torch.randn(12, 3, 32, 32, generator=g, dtype=torch.float64)
    tokens, negatives = torch.randint(1, 1000, (2, 12, 32), generator=g)
    mask = torch.arange(12) % 3 != 0
    acc = Accelerator(cpu=True)

    def grads(micro):
        model.zero_grad(set_to_none=True)
        out = forward_backward(acc, model, objective, images, tokens, negative_tokens=negatives, micro_batch=micro,
                               context={"negative_mask": mask})
        return out.loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    full_loss, full = grads(None)
    loss, cached = grads(4)
    torch.testing.assert_close(loss, full_loss, rtol=1e-12, atol=0)
    assert "clip.token_embedding.weight" in full
    for n in full:
        torch.testing.assert_close(cached[n], full[n], rtol=1e-9, atol=1e-12, msg=n)
    model.zero_grad(set_to_none=True)
    plain = forward_backward(acc, model, objective, images, tokens, negative_tokens=negatives,
                             context={"negative_mask": torch.zeros(12, dtype=torch.bool)}).loss
    assert full_loss > plain  # the negatives are in the loss


# ---- the commands: negatives made, built from a column, trained on; bad lists counted ----

def test_negatives_command_then_training_counts_malformed_lists(openmoji, tmp_path):
    """`data_tools negatives` writes a copy with seeded swap/replace negatives (same again for the same
    seed); training with hard_negatives reads them; a sample whose list is malformed is a counted skip."""
    import io
    import tarfile

    from mmpretrain.data.tar import read_tar

    from conftest import ROOT, run_main, train

    out = tmp_path / "neg"
    r = run_main("data_tools", "negatives", str(openmoji / "train"), "--out", str(out), "--seed", "3")
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads(r.stdout)
    assert summary["samples"] > 100 and summary["negatives"] > summary["samples"]  # swap + replace mostly
    shard = sorted(out.glob("*.tar"))[0]
    first = [(s["txt"].decode(), json.loads(s["json"]).get("negative_captions")) for s in read_tar(shard)]
    for caption, negs in first[:50]:
        assert negs is None or (caption not in negs and len(negs) <= 2)
    again = tmp_path / "neg2"
    assert run_main("data_tools", "negatives", str(openmoji / "train"), "--out", str(again), "--seed", "3").returncode == 0
    assert [json.loads(s["json"]).get("negative_captions") for s in read_tar(sorted(again.glob("*.tar"))[0])] == \
        [n for _, n in first]
    r = run_main("data_tools", "negatives", str(openmoji / "train"), "--out", str(out))
    assert r.returncode == 2 and "--overwrite" in r.stderr  # a dataset is there: not replaced silently
    r = run_main("data_tools", "negatives", str(openmoji / "train"), "--out", str(openmoji / "train" / "x"))
    assert r.returncode == 2 and "inside the source" in r.stderr
    # an interrupted run (manifest written first, one shard done, one half-written) beside a user's file:
    # the rerun clears only its own files and finishes; a tar nothing wrote is refused
    cut = tmp_path / "cut"
    shutil.copytree(again, cut)
    (cut / "sizes.json").unlink()
    record = json.loads((cut / "manifest.json").read_text())
    (cut / "manifest.json").write_text(json.dumps({"negatives": {**record["negatives"], "pending": True}}))
    names = sorted(p.name for p in cut.glob("*.tar"))
    (cut / names[1]).rename(cut / (names[1] + ".tmp"))
    for n in names[2:]:
        (cut / n).unlink()
    (cut / "notes.txt").write_text("mine")
    assert run_main("data_tools", "negatives", str(openmoji / "train"), "--out", str(cut), "--seed", "3").returncode == 0
    assert (cut / "notes.txt").read_text() == "mine" and not list(cut.glob("*.tmp"))
    assert list(read_tar(cut / names[-1])) == list(read_tar(again / names[-1]))  # the same samples (tar mtimes differ)
    # a manifest.json no run of ours left (no sizes.json, no pending record): refused, kept
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "manifest.json").write_text('{"source": "my notes"}')
    r = run_main("data_tools", "negatives", str(openmoji / "train"), "--out", str(mine))
    assert r.returncode == 2 and "--overwrite" in r.stderr
    assert (mine / "manifest.json").read_text() == '{"source": "my notes"}'
    (cut / "sizes.json").unlink()
    shutil.copy(shard, cut / "theirs.tar")
    r = run_main("data_tools", "negatives", str(openmoji / "train"), "--out", str(cut))
    assert r.returncode == 2 and "theirs.tar" in r.stderr and (cut / "theirs.tar").is_file()

    # two samples of the first shard get a malformed list: each is a counted skip
    members = []
    with tarfile.open(shard) as t:
        for m in t.getmembers():
            data = t.extractfile(m).read()
            if m.name.endswith(".json") and len([x for x in members if x[0].endswith(".json")]) < 2:
                data = json.dumps({**json.loads(data), "negative_captions": [""]}).encode()
            members.append((m.name, data))
    with tarfile.open(shard, "w") as t:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    run_dir = tmp_path / "run"
    r = train(out, run_dir, "loss=[{name: clip, options: {hard_negatives: true}}]", "train.epochs=1",
              "data.batch_size=64", "data.num_workers=1", config=ROOT / "configs/tiny/clip.yaml")
    assert r.returncode == 0, r.stderr[-3000:]
    log = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    assert log[-1]["skipped"].get("bad_negative_captions") == 2
    assert 0.9 < log[-1]["clip/negative_share"] <= 1.0  # almost every caption got a negative
