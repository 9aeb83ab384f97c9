"""``distill`` against a naive reference, open_clip's ``DistillClipLoss`` and the ensemble rule (the
members' softmaxes averaged), in value and gradient: untiled and tiled, on 2 gloo ranks, under bf16."""

import pytest
import torch
import torch.nn.functional as F
from open_clip.loss import DistillClipLoss

from mmpretrain.losses import LOSSES, build_objective

from ddp_helpers import run_ranks

B, D = 12, 16
DIMS = (8, 24)  # a two-teacher ensemble: rows side by side
TOL = dict(rtol=1e-6, atol=1e-9)


def inputs(seed=0, b=B, dims=DIMS, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = F.normalize(torch.randn(b, D, generator=g, dtype=dtype), dim=-1).requires_grad_()
    y = F.normalize(torch.randn(b, D, generator=g, dtype=dtype), dim=-1).requires_grad_()
    # the teacher's texts correlate with its images (a trained teacher), and the student's with neither
    u = torch.cat([F.normalize(torch.randn(b, e, generator=g, dtype=dtype), dim=-1) for e in dims], 1)
    v = torch.cat([F.normalize(p + 0.5 * torch.randn(b, p.shape[1], generator=g, dtype=dtype), dim=-1)
                   for p in u.split(list(dims), 1)], 1)
    return x, y, u, v


def naive_distill(x, y, u, v, s, s_t, dims):
    """The docstring's formula, one row and one member at a time."""
    b = x.shape[0]
    us = [F.normalize(p, dim=-1) for p in u.split(list(dims), 1)]
    vs = [F.normalize(p, dim=-1) for p in v.split(list(dims), 1)]
    total = 0.0
    for i in range(b):
        p_i = sum(torch.softmax(torch.stack([s_t * um[i] @ vm[j] for j in range(b)]), 0) for um, vm in zip(us, vs))
        p_t = sum(torch.softmax(torch.stack([s_t * vm[i] @ um[j] for j in range(b)]), 0) for um, vm in zip(us, vs))
        li = torch.log_softmax(torch.stack([s * x[i] @ y[j] for j in range(b)]), 0)
        lt = torch.log_softmax(torch.stack([s * y[i] @ x[j] for j in range(b)]), 0)
        total = total - (p_i / len(dims) * li).sum() - (p_t / len(dims) * lt).sum()
    return total / (2 * b)


def ours(x, y, u, v, s, dims, **options):
    return LOSSES["distill"](**options)(image_features=x, text_features=y, logit_scale=s,
                                        teacher_image_embeddings=u, teacher_text_embeddings=v,
                                        teacher_dims=dims)["distill_loss"]


@pytest.mark.parametrize("dims", [(32,), DIMS], ids=["one-teacher", "ensemble"])
@pytest.mark.parametrize("chunk", [None, 1, 5, 64])
def test_distill_equals_naive_reference(dims, chunk):
    x, y, u, v = inputs(1, dims=dims)
    s = torch.tensor(7.0, dtype=torch.float64, requires_grad=True)
    got = ours(x, y, u, v, s, dims, teacher_scale=20.0, chunk_size=chunk)
    ref = naive_distill(x, y, u, v, s, 20.0, dims)
    torch.testing.assert_close(got, ref, **TOL)
    for a, b in zip(torch.autograd.grad(got, (x, y, s)), torch.autograd.grad(ref, (x, y, s))):
        torch.testing.assert_close(a, b, **TOL)


def test_distill_is_open_clips_distill_loss_for_one_teacher():
    """open_clip's DistillClipLoss (one teacher, its scale given as 100) gives the same distill term."""
    x, y, u, v = inputs(2, dims=(32,))
    s = torch.tensor(9.0, dtype=torch.float64, requires_grad=True)
    theirs = DistillClipLoss()(x, y, s, u, v, torch.tensor(100.0, dtype=torch.float64), output_dict=True)
    got = ours(x, y, u, v, s, (32,))  # teacher_scale defaults to 100, as DataCompDR
    torch.testing.assert_close(got, theirs["distill_loss"], **TOL)
    for a, b in zip(torch.autograd.grad(got, (x, y, s)), torch.autograd.grad(theirs["distill_loss"], (x, y, s))):
        torch.testing.assert_close(a, b, **TOL)


def test_ensemble_averages_softmaxes_not_rows():
    """Two teachers: the mean of their two distributions, which is not the distribution of their rows
    concatenated (what a wrong split would compute)."""
    x, y, u, v = inputs(3)
    got = ours(x, y, u, v, 9.0, DIMS)
    concatenated = ours(x, y, F.normalize(u, dim=-1), F.normalize(v, dim=-1), 9.0, None)
    singles = [ours(x, y, p, q, 9.0, None) for p, q in zip(u.split(list(DIMS), 1), v.split(list(DIMS), 1))]
    # cross-entropy is linear in the target distribution: the average of the members' losses
    torch.testing.assert_close(got, sum(singles) / 2, **TOL)
    assert abs(float((got - concatenated).detach())) > 1e-3


def test_distill_gradcheck_tiled():
    x, y, u, v = inputs(4, b=7)
    fn = LOSSES["distill"](chunk_size=3, teacher_scale=10.0)
    assert torch.autograd.gradcheck(
        lambda x, y: fn(image_features=x, text_features=y, logit_scale=4.0, teacher_image_embeddings=u,
                        teacher_text_embeddings=v, teacher_dims=DIMS)["distill_loss"], (x, y))


def test_distill_refusals_and_weights():
    x, y, u, v = inputs(5)
    with pytest.raises(ValueError, match="teacher_scale"):
        LOSSES["distill"](teacher_scale=0)
    with pytest.raises(ValueError, match="image-model"):
        LOSSES["distill"]()(image_features=x, text_features=y, logit_scale=5.0)
    with pytest.raises(ValueError, match="teacher_dims"):
        ours(x, y, u, v, 5.0, (8, 8))
    both = build_objective([{"name": "clip", "weight": 0.0}, {"name": "distill", "weight": 1.0}])
    assert "teacher" in both.needs and "teacher" not in build_objective([{"name": "clip"}]).needs
    out = both(image_features=x, text_features=y, logit_scale=5.0, teacher_image_embeddings=u,
               teacher_text_embeddings=v, teacher_dims=DIMS)
    assert float(out["clip_loss"]) == 0.0 and float(out["clip_unweighted"]) > 0
    torch.testing.assert_close(out["distill_loss"], ours(x, y, u, v, 5.0, DIMS))


@pytest.mark.parametrize("chunk", [None, 4])
def test_distill_under_bf16_autocast(chunk):
    """bf16 features under CPU autocast (as a GPU run's): within bf16's rounding of the fp32 loss and
    gradient; the teacher side stays fp32."""
    x, y, u, v = inputs(6, dtype=torch.float32)
    s = torch.tensor(9.0, requires_grad=True)
    ref = ours(x, y, u, v, s, DIMS, chunk_size=chunk)
    g_ref = torch.autograd.grad(ref, (x, y))
    xb = x.detach().bfloat16().requires_grad_()
    yb = y.detach().bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = ours(xb, yb, u, v, s, DIMS, chunk_size=chunk)
    g = torch.autograd.grad(got, (xb, yb))
    assert torch.isfinite(got) and abs(float(got) - float(ref)) < 0.02 * float(ref)
    for a, b in zip(g, g_ref):
        assert float((a.float() - b).norm() / b.norm()) < 0.05


def _rank_distill(rank, world, chunk):
    x, y, u, v = inputs(7)
    b = B // world
    sl = slice(rank * b, (rank + 1) * b)
    xl, yl = x.detach()[sl].clone().requires_grad_(), y.detach()[sl].clone().requires_grad_()
    s = torch.tensor(8.0, dtype=torch.float64, requires_grad=True)
    loss = ours(xl, yl, u[sl], v[sl], s, DIMS, rank=rank, world_size=world, chunk_size=chunk)
    return (loss.detach(), *torch.autograd.grad(loss, (xl, yl, s)))


@pytest.mark.parametrize("chunk", [None, 4])
def test_distill_on_two_ranks_equals_one_process(tmp_path, chunk):
    x, y, u, v = inputs(7)
    s = torch.tensor(8.0, dtype=torch.float64, requires_grad=True)
    full = ours(x, y, u, v, s, DIMS)
    gx, gy, gs = torch.autograd.grad(full, (x, y, s))
    res = run_ranks(_rank_distill, (chunk,), tmp_path, world=2)
    torch.testing.assert_close(torch.stack([r[0] for r in res]).mean(), full.detach(), **TOL)
    # DDP averages gradients over ranks: rank r's feature gradient / world is the one-process slice's
    torch.testing.assert_close(torch.cat([r[1] for r in res]) / 2, gx, **TOL)
    torch.testing.assert_close(torch.cat([r[2] for r in res]) / 2, gy, **TOL)
    torch.testing.assert_close(torch.stack([r[3] for r in res]).mean(), gs, **TOL)
