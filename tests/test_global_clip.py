"""``global_clip`` (SogCLR / FastCLIP-v3) against references written from docs/methods.md and from
FastCLIP's ``FastCLIPLoss`` (Optimization-AI/fast_clip, src/fast_clip/loss.py, transcribed below, not
imported): the feature gradient at γ = 1, the ``u`` update, the v3 surrogate's value and gradients,
the duplicate-index rule, accepted-steps-only updates, 2 and 4 gloo ranks equal to one process, and
in the trainer: gradient caching, a skipped non-finite step, the tables in every checkpoint and a
resume bit for bit."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from test_train import _NanAt  # the run's objective with a non-finite loss at one step

from mmpretrain.losses import LOSSES
from mmpretrain.losses.global_clip import gamma_at, last_occurrence

from conftest import ROOT, setup_run, train
from ddp_helpers import run_ranks

B, D, N = 12, 16, 40
TOL = dict(rtol=1e-7, atol=1e-10)


def feats(seed, b=B):
    g = torch.Generator().manual_seed(seed)
    x = F.normalize(torch.randn(b, D, generator=g, dtype=torch.float64), dim=-1).requires_grad_()
    y = F.normalize(torch.randn(b, D, generator=g, dtype=torch.float64), dim=-1).requires_grad_()
    return x, y


def naive_g(x, y, s):
    """``g_i^I``, ``g_i^T`` by the formula, one pair at a time."""
    n = x.shape[0]
    gi, gt = [], []
    for i in range(n):
        pos = x[i] @ y[i]
        gi.append(sum(torch.exp(s * (x[i] @ y[j] - pos)) for j in range(n) if j != i) / (n - 1))
        gt.append(sum(torch.exp(s * (y[i] @ x[j] - pos)) for j in range(n) if j != i) / (n - 1))
    return torch.stack(gi), torch.stack(gt)


def make(**options):
    """Tables in float64 (``.double()`` casts the buffers), so the references can be compared tightly."""
    return LOSSES["global_clip"](index_size=N, **options).double()


def same(a, b):
    """Equal to the bit, NaN (never seen) included."""
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def call(obj, x, y, s, index, epoch):
    return obj(image_features=x, text_features=y, logit_scale=s, sample_index=index, epoch=epoch)


def test_gamma_one_gradient_is_that_of_the_mean_log_normalisers():
    """With γ = 1 (u = g) the feature gradient is that of (1/B) Σ (log g^I + log g^T): no ½, and the
    positive pair is not in the denominator -- so not clip's."""
    x, y = feats(0)
    s = torch.tensor(9.0, dtype=torch.float64)
    out = call(make(temperature_scheme="fixed", gamma=1.0), x, y, s, torch.arange(B), 1)
    assert out["global_clip_loss"].item() == pytest.approx(2.0, rel=1e-12)  # g/u = 1 for every row and side
    gi, gt = naive_g(x, y, s)
    ref = (gi.log() + gt.log()).mean()
    got = torch.autograd.grad(out["global_clip_loss"], (x, y))
    want = torch.autograd.grad(ref, (x, y))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)
    clip = LOSSES["clip"]()(image_features=x, text_features=y, logit_scale=s)["clip_loss"]
    assert not torch.allclose(torch.autograd.grad(clip, x)[0], got[0], rtol=1e-3)


def test_u_update_follows_its_formula_and_moves_only_on_accepted_steps():
    gamma = 0.3
    obj = make(temperature_scheme="fixed", gamma=gamma, gamma_schedule="constant")
    s = torch.tensor(7.0, dtype=torch.float64)
    x1, y1 = feats(1)
    first = torch.arange(B)  # samples 0..11
    call(obj, x1, y1, s, first, epoch=1)  # epoch 0 (0-based): γ = 1, u = g
    assert torch.isnan(obj.log_u_image).all()  # proposed only
    obj.commit_step()
    gi1, gt1 = naive_g(x1.detach(), y1.detach(), s)
    torch.testing.assert_close(obj.log_u_image[:B].double(), gi1.log(), rtol=1e-6, atol=0)
    torch.testing.assert_close(obj.log_u_text[:B].double(), gt1.log(), rtol=1e-6, atol=0)
    assert torch.isnan(obj.log_u_image[B:]).all()

    # second step: half seen before, half new; epoch 2 -> γ = gamma
    x2, y2 = feats(2)
    index = torch.arange(6, 6 + B)
    old_i, old_t = obj.log_u_image.clone(), obj.log_u_text.clone()
    out = call(obj, x2, y2, s, index, epoch=2)
    gi, gt = naive_g(x2, y2, s)
    seen = index < B
    u_i = torch.where(seen, (1 - gamma) * old_i[index].double().exp() + gamma * gi.detach(), gi.detach())
    u_t = torch.where(seen, (1 - gamma) * old_t[index].double().exp() + gamma * gt.detach(), gt.detach())
    f = (gi / u_i + gt / u_t).mean()  # u constant
    torch.testing.assert_close(out["global_clip_loss"], f, **TOL)
    for a, b in zip(torch.autograd.grad(out["global_clip_loss"], (x2, y2)), torch.autograd.grad(f, (x2, y2))):
        torch.testing.assert_close(a, b, **TOL)
    obj.discard_step()  # a skipped step: nothing moves
    same(obj.log_u_image, old_i)
    same(obj.log_u_text, old_t)
    call(obj, x2.detach(), y2.detach(), s, index, epoch=2)
    obj.commit_step()
    torch.testing.assert_close(obj.log_u_image[index].double(), u_i.log(), rtol=1e-6, atol=0)
    torch.testing.assert_close(obj.log_u_text[index].double(), u_t.log(), rtol=1e-6, atol=0)
    same(obj.log_u_image[:6], old_i[:6])  # samples outside the batch keep theirs


def test_a_repeated_index_keeps_its_last_occurrence():
    index = torch.tensor([3, 5, 3, 7, 5, 3])
    assert last_occurrence(index).tolist() == [5, 4, 5, 3, 4, 5]  # where each index occurs last
    obj = make(temperature_scheme="fixed")
    x, y = feats(3, b=6)
    s = torch.tensor(5.0, dtype=torch.float64)
    call(obj, x, y, s, index, epoch=1)
    before = obj.log_u_image.clone(), obj.log_u_text.clone()
    obj.commit_step(torch.tensor(False))  # a step rejected on the device (train/nonfinite.py): nothing moves
    for table, old in zip((obj.log_u_image, obj.log_u_text), before):  # unset entries are NaN
        torch.testing.assert_close(table, old, rtol=0, atol=0, equal_nan=True)
    call(obj, x, y, s, index, epoch=1)
    obj.commit_step(torch.tensor(True))
    gi, _ = naive_g(x.detach(), y.detach(), s)
    assert obj.log_u_image[3].item() == pytest.approx(gi[5].log().item(), rel=1e-6)
    assert obj.log_u_image[5].item() == pytest.approx(gi[4].log().item(), rel=1e-6)


def test_gamma_schedule_is_fastclips():
    assert gamma_at(0, 0.2, "cosine", 4) == 1.0 and gamma_at(0, 0.2, "constant", 4) == 1.0
    assert gamma_at(2, 0.2, "cosine", 4) == pytest.approx(0.5 * (1 + math.cos(math.pi / 2)) * 0.8 + 0.2)
    assert gamma_at(4, 0.2, "cosine", 4) == 0.2 and gamma_at(9, 0.2, "cosine", 4) == 0.2
    assert gamma_at(1, 0.2, "constant", 4) == 0.2


class FastClipTranscription:
    """FastCLIP's ``FastCLIPLoss`` (global temperature, ``multiply_tau=True``) on one process, where
    ``remote_features`` are the features themselves: ``pairwise_loss``, ``local`` and ``forward``,
    written out from its source (u tables in linear scale, eps = 1e-14 as there)."""

    def __init__(self, data_size, gamma, gamma_schedule, gamma_decay_epochs, rho, eps=1e-14):
        self.gamma_orig, self.gamma_schedule, self.gamma_decay_epochs = gamma, gamma_schedule, gamma_decay_epochs
        self.rho, self.eps, self.gamma = rho, eps, 1.0
        self.u_im = torch.zeros(data_size, dtype=torch.float64).reshape(-1, 1)
        self.u_tt = torch.zeros(data_size, dtype=torch.float64).reshape(-1, 1)

    def adjust_gamma(self, epoch):
        if epoch == 0:
            self.gamma = 1.0
        elif epoch >= self.gamma_decay_epochs:
            self.gamma = self.gamma_orig
        else:
            self.gamma = self.gamma_orig
            if self.gamma_schedule == "cosine":
                self.gamma = 0.5 * (1 + math.cos(math.pi * epoch / self.gamma_decay_epochs)) * \
                    (1 - self.gamma_orig) + self.gamma_orig

    def pairwise_loss(self, features1, features2, logit_scale, sim=None):
        image_features1, text_features1 = features1
        image_features2, text_features2 = features2
        b1, b2 = image_features1.shape[0], image_features2.shape[0]
        if sim is not None:
            sim_image, sim_text = sim
        else:
            sim_image = image_features1 @ text_features2.T
            sim_text = text_features1 @ image_features2.T
        diag_sim = torch.sum(image_features1 * text_features1, dim=-1, keepdim=True)
        exp_diff_image = torch.exp((sim_image - diag_sim) * logit_scale)
        exp_diff_text = torch.exp((sim_text - diag_sim) * logit_scale)
        mask = 1 - torch.nn.functional.one_hot(torch.arange(min(b1, b2)), max(b1, b2)).to(torch.float64)
        if b1 > b2:
            mask = mask.T
        exp_diff_image, exp_diff_text = exp_diff_image * mask, exp_diff_text * mask
        real_weights_sum = b2 - 1 if b1 <= b2 else b2 * (b1 - 1) / b1
        return (exp_diff_image.sum(-1, keepdim=True) / real_weights_sum,
                exp_diff_text.sum(-1, keepdim=True) / real_weights_sum, sim_image, sim_text)

    def step(self, features, ids, logit_scale):
        # local()
        u_im, u_tt = self.u_im[ids], self.u_tt[ids]
        loss1_im, loss1_tt, sim_im, sim_tt = self.pairwise_loss(features, features, logit_scale)
        g_im, g_tt = loss1_im.detach(), loss1_tt.detach()
        if self.gamma < 1.0:
            bad_im = torch.nonzero((u_im < 1e-35) | u_im.isinf() | u_im.isnan(), as_tuple=True)[0]
            bad_tt = torch.nonzero((u_tt < 1e-35) | u_tt.isinf() | u_tt.isnan(), as_tuple=True)[0]
        u_im = (1.0 - self.gamma) * u_im + self.gamma * g_im
        u_tt = (1.0 - self.gamma) * u_tt + self.gamma * g_tt
        if self.gamma < 1.0:
            u_im[bad_im] = g_im[bad_im]
            u_tt[bad_tt] = g_tt[bad_tt]
        self.u_im[ids], self.u_tt[ids] = u_im, u_tt
        # forward(), remote = local
        loss2_im, loss2_tt, _, _ = self.pairwise_loss(features, features, logit_scale, sim=(sim_im, sim_tt))
        loss = (torch.mean(loss1_im / (u_im + self.eps) + loss1_tt / (u_tt + self.eps))
                + torch.mean(loss2_im / (u_im + self.eps) + loss2_tt / (u_tt + self.eps))) / 2
        loss = loss / logit_scale.detach()
        loss = loss + self.rho / logit_scale
        return loss + torch.mean(torch.log(u_im) + torch.log(u_tt)) / 2 / logit_scale


def test_v3_surrogate_matches_fastclips_loss_in_value_and_gradients():
    """Three steps over overlapping samples (γ = 1 at epoch 0, then the cosine decay): the loss, the
    feature gradients and the temperature's gradient equal FastCLIP's, and so do the u tables."""
    ours = make(gamma=0.4, gamma_schedule="cosine", gamma_decay_epochs=3, rho=7.0)
    ref = FastClipTranscription(N, 0.4, "cosine", 3, 7.0)
    for step, (epoch0, start) in enumerate([(0, 0), (1, 6), (2, 3)]):
        x, y = feats(10 + step)
        ids = torch.arange(start, start + B)
        s1 = torch.tensor(8.0 + step, dtype=torch.float64, requires_grad=True)
        s2 = torch.tensor(8.0 + step, dtype=torch.float64, requires_grad=True)
        x2, y2 = x.detach().clone().requires_grad_(), y.detach().clone().requires_grad_()
        a = call(ours, x, y, s1, ids, epoch=epoch0 + 1)["global_clip_loss"]
        ref.adjust_gamma(epoch0)
        b = ref.step((x2, y2), ids, s2)
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
        for u, v in zip(torch.autograd.grad(a, (x, y, s1)), torch.autograd.grad(b, (x2, y2, s2))):
            torch.testing.assert_close(u, v, rtol=1e-9, atol=1e-12)
        ours.commit_step()
        seen = ref.u_im.squeeze(1) > 0
        torch.testing.assert_close(ours.log_u_image[seen].double(), ref.u_im.squeeze(1)[seen].log(), rtol=1e-6, atol=0)
        torch.testing.assert_close(ours.log_u_text[seen].double(), ref.u_tt.squeeze(1)[seen].log(), rtol=1e-6, atol=0)


def test_options_are_checked():
    for bad, match in [({"gamma": 0.0}, "gamma"), ({"gamma_schedule": "linear"}, "gamma_schedule"),
                       ({"temperature_scheme": "individual"}, "per-sample"), ({"chunk_size": 64}, "chunk_size")]:
        with pytest.raises(ValueError, match=match):
            make(**bad)
    with pytest.raises(RuntimeError, match="outside"):
        call(make(), *feats(0), torch.tensor(9.0), torch.arange(N, N + B), 1)
    from mmpretrain.losses import build_objective

    with pytest.raises(ValueError, match="smaller than the training data's 50 samples"):
        build_objective([{"name": "global_clip", "options": {"index_size": 20}}], index_size=50)
    assert build_objective([{"name": "global_clip"}], index_size=50).terms[0].log_u_text.numel() == 50


# ---------------------------------------------------------------- 2 and 4 gloo ranks

def _two_steps(rank, world):
    """Step 1 (γ = 1) committed, then step 2 (γ = 0.5) over partly seen samples: each rank's loss,
    gradients and tables."""
    obj = LOSSES["global_clip"](index_size=N, gamma=0.5, gamma_schedule="constant", rank=rank, world_size=world)
    b = B // world
    out = []
    for step, start in enumerate((0, 5)):
        x, y = feats(20 + step)
        sl = slice(rank * b, (rank + 1) * b)
        xl, yl = x.detach()[sl].clone().requires_grad_(), y.detach()[sl].clone().requires_grad_()
        s = torch.tensor(9.0, dtype=torch.float64, requires_grad=True)
        loss = call(obj, xl, yl, s, torch.arange(start, start + B)[sl], epoch=step + 1)["global_clip_loss"]
        out.append((loss.detach(), *torch.autograd.grad(loss, (xl, yl, s))))
        obj.commit_step()
    return out, obj.log_u_image.clone(), obj.log_u_text.clone()


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ranks_equal_one_process(tmp_path, world):
    one, ti, tt = _two_steps(0, 1)
    ranks = run_ranks(_two_steps, (), tmp_path, world=world)
    for step in range(2):
        res = [r[0][step] for r in ranks]
        torch.testing.assert_close(torch.stack([r[0] for r in res]).mean(), one[step][0], **TOL)
        torch.testing.assert_close(torch.cat([r[1] for r in res]) / world, one[step][1], **TOL)  # DDP averages
        torch.testing.assert_close(torch.cat([r[2] for r in res]) / world, one[step][2], **TOL)
        torch.testing.assert_close(torch.stack([r[3] for r in res]).mean(), one[step][3], **TOL)
    for r in ranks:  # replicated tables, identical on every rank
        same(r[1], ranks[0][1])
        same(r[2], ranks[0][2])
        torch.testing.assert_close(r[1], ti, rtol=1e-6, atol=0, equal_nan=True)
        torch.testing.assert_close(r[2], tt, rtol=1e-6, atol=0, equal_nan=True)


# ---------------------------------------------------------------- in the trainer

GLOBAL = "loss=[{name: global_clip, options: {gamma: 0.5, gamma_schedule: constant}}]"
COMMON = ["data.batch_size=16", "data.shuffle_buffer=32", "optim.warmup_steps=2", "train.log_every=1",
          "train.keep_last=2"]


def test_trainer_commits_accepted_steps_only_with_grad_caching(openmoji, tmp_path):
    from mmpretrain.config import load_config
    from mmpretrain.train import fit

    run = setup_run(openmoji / "train", tmp_path / "r", *COMMON, GLOBAL, "train.steps=3", "train.save_every=1",
                    "data.num_workers=0", "train.nonfinite=skip", "train.keep_last=3", "train.micro_batch_size=8")
    assert run.objective.terms[0].log_u_image.numel() == sum(
        json.loads((openmoji / "train/sizes.json").read_text()).values())
    run.objective = _NanAt(run.objective, 1, run)  # step 2 (0-based 1) is skipped
    fit(run)
    tables = [load_file(tmp_path / f"r/checkpoints/step_0000000{i}/objective.safetensors") for i in (1, 2, 3)]
    seen = [int(torch.isfinite(t["terms.0.log_u_image"]).sum()) for t in tables]
    assert seen == [16, 16, 32]  # the skipped step moved nothing; epoch mode: no sample twice
    same(tables[0]["terms.0.log_u_image"], tables[1]["terms.0.log_u_image"])

    bad = load_config  # accumulation would give each micro-batch its own estimates: refused
    with pytest.raises(ValueError, match="global_clip needs the whole batch"):
        bad(ROOT / "configs/demo.yaml", [f"data.train={openmoji / 'train'}", *COMMON, GLOBAL, "train.steps=3",
                                         "train.micro_batch_size=8", "train.micro_batch_mode=accumulate"])


def test_trainer_saves_the_tables_and_resumes_bit_for_bit(openmoji, tmp_path):
    def run(run_dir):
        return train(openmoji / "train", run_dir, *COMMON, GLOBAL, "train.steps=6", "train.save_every=3",
                     "data.num_workers=2")

    a = tmp_path / "a"
    r = run(a)
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(x) for x in (a / "log.jsonl").read_text().splitlines()]
    assert all("global_clip/log_u" in rec and math.isfinite(rec["global_clip_loss"]) for rec in records if "loss" in rec)
    b = tmp_path / "b"
    shutil.copytree(a, b)
    shutil.rmtree(b / "checkpoints/step_00000006")
    (b / "log.jsonl").write_text("\n".join((a / "log.jsonl").read_text().splitlines()[:3]) + "\n")
    r = run(b)
    assert r.returncode == 0 and "step 3" in r.stderr, r.stderr[-3000:]
    for name in ("objective.safetensors", "model.safetensors"):
        sa = load_file(a / "checkpoints/step_00000006" / name)
        sb = load_file(b / "checkpoints/step_00000006" / name)
        assert sa.keys() == sb.keys(), name
        for k in sa:
            same(sa[k], sb[k])
    la = [json.loads(x) for x in (a / "log.jsonl").read_text().splitlines()]
    lb = [json.loads(x) for x in (b / "log.jsonl").read_text().splitlines()]
    assert [x.get("loss") for x in la] == [x.get("loss") for x in lb]
