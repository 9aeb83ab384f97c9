"""Objectives against references (open_clip.loss, naive formulas) in value and gradient, on one
process and on 2 gloo ranks."""

import math

import pytest
import torch
import torch.nn.functional as F
from open_clip.loss import ClipLoss as OpenClipLoss

from mmpretrain.losses import LOSSES, build_objective

from ddp_helpers import run_ranks

B, D, E = 12, 16, 24


def inputs(seed=0, b=B):
    g = torch.Generator().manual_seed(seed)
    x = F.normalize(torch.randn(b, D, generator=g), dim=-1).requires_grad_()
    y = F.normalize(torch.randn(b, D, generator=g), dim=-1).requires_grad_()
    t = F.normalize(torch.randn(b, E, generator=g), dim=-1)
    return x, y, t


def naive_soft_target(x, y, t, s, tau_s):
    """methods.md: L = -1/(2B) sum_ij G_ij [log softmax_j(s x_i.y_j) + log softmax_j(s y_i.x_j)]."""
    b = x.shape[0]
    total = 0.0
    for i in range(b):
        g = torch.exp(torch.stack([t[i] @ t[j] / tau_s for j in range(b)]))
        g = g / g.sum()
        li = torch.stack([s * x[i] @ y[j] for j in range(b)])
        lt = torch.stack([s * y[i] @ x[j] for j in range(b)])
        total = total - (g * (li - torch.logsumexp(li, 0))).sum() - (g * (lt - torch.logsumexp(lt, 0))).sum()
    return total / (2 * b)


def grads(loss, *ts):
    return torch.autograd.grad(loss, ts)


@pytest.mark.parametrize("local_loss", [False, True])
def test_clip_matches_open_clip(local_loss):
    x, y, _ = inputs()
    s = torch.tensor(1 / 0.07)
    ours = LOSSES["clip"](local_loss=local_loss)(image_features=x, text_features=y, logit_scale=s)["clip_loss"]
    ref = OpenClipLoss()(x, y, s)
    torch.testing.assert_close(ours, ref)
    for a, b in zip(grads(ours, x, y), grads(ref, x, y)):
        torch.testing.assert_close(a, b)


def test_soft_target_matches_naive_and_reduces_to_clip():
    x, y, t = inputs(1)
    s, tau = 7.0, 0.3
    ours = LOSSES["soft_target"](target_temperature=tau)(
        image_features=x, text_features=y, logit_scale=s, target_embeddings=t)["soft_target_loss"]
    ref = naive_soft_target(x, y, t, s, tau)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads(ours, x, y), grads(ref, x, y)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # identical-caption-free targets at tiny tau: G -> I, the loss -> CLIP
    tiny = LOSSES["soft_target"](target_temperature=1e-4)(
        image_features=x, text_features=y, logit_scale=s, target_embeddings=t)["soft_target_loss"]
    clip = LOSSES["clip"]()(image_features=x, text_features=y, logit_scale=s)["clip_loss"]
    torch.testing.assert_close(tiny, clip, rtol=1e-4, atol=1e-5)


def test_soft_target_image_image_single_view_masks_diagonal():
    x, _, t = inputs(2)
    tau_s, temp = 0.5, 0.1
    ours = LOSSES["soft_target"](space="image_image", target_temperature=tau_s, temperature=temp)(
        image_features=x, text_features=x, logit_scale=1.0, target_embeddings=t)["soft_target_loss"]
    eye = torch.eye(B, dtype=torch.bool)
    g = (t @ t.T / tau_s).masked_fill(eye, -math.inf).softmax(1)
    logp = (x @ x.T / temp).masked_fill(eye, -math.inf).log_softmax(1)
    ref = -(g * logp.masked_fill(eye, 0)).sum(1).mean()
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(grads(ours, x)[0], grads(ref, x)[0])


def test_objective_sums_weighted_terms():
    x, y, t = inputs(3)
    obj = build_objective([{"name": "clip", "weight": 1.0}, {"name": "soft_target", "weight": 0.5}])
    out = obj(image_features=x, text_features=y, logit_scale=10.0, target_embeddings=t, unused_keyword=1)
    assert set(k for k in out if k.endswith("_loss")) == {"clip_loss", "soft_target_loss"}
    torch.testing.assert_close(out["soft_target_loss"], 0.5 * out["soft_target_unweighted"])


def test_rejected_combinations():
    with pytest.raises(ValueError, match="gather_with_grad"):
        LOSSES["clip"](local_loss=True, gather_with_grad=False)
    with pytest.raises(ValueError, match="target_embeddings"):
        x, y, _ = inputs()
        LOSSES["soft_target"]()(image_features=x, text_features=y, logit_scale=1.0)


# ---------------------------------------------------------------- 2 gloo ranks

def _rank_loss(rank, world, name, options):
    x, y, t = inputs(5, b=B)  # the same global batch on every rank; each takes its slice
    b = B // world
    sl = slice(rank * b, (rank + 1) * b)
    xl = x.detach()[sl].clone().requires_grad_()
    yl = y.detach()[sl].clone().requires_grad_()
    loss_fn = LOSSES[name](rank=rank, world_size=world, **options)
    out = loss_fn(image_features=xl, text_features=yl, logit_scale=torch.tensor(9.0), target_embeddings=t[sl])
    loss = out[f"{name}_loss"]
    gx, gy = torch.autograd.grad(loss, (xl, yl))
    return loss.detach(), gx, gy


@pytest.mark.parametrize(
    "name, options",
    [
        ("clip", {}),
        ("clip", {"local_loss": True}),
        ("clip", {"gather_with_grad": False}),
        ("soft_target", {"target_temperature": 0.2}),
    ],
)
def test_two_ranks_equal_one_process(tmp_path, name, options):
    world = 2
    res = run_ranks(_rank_loss, (name, options), tmp_path, world)
    x, y, t = inputs(5)
    full = LOSSES[name](**options)(image_features=x, text_features=y, logit_scale=torch.tensor(9.0),
                                   target_embeddings=t)[f"{name}_loss"]
    gx, gy = torch.autograd.grad(full, (x, y))
    # mean over ranks of the losses == the one-process loss
    torch.testing.assert_close(torch.stack([r[0] for r in res]).mean(), full)
    # DDP averages parameter gradients over ranks, so rank r's feature gradient / world must equal
    # the one-process gradient of its slice
    torch.testing.assert_close(torch.cat([r[1] for r in res]) / world, gx)
    torch.testing.assert_close(torch.cat([r[2] for r in res]) / world, gy)
