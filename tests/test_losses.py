"""Objectives against references (open_clip.loss, naive formulas) in value and gradient, on one
process and on 2 gloo ranks."""

import math

import pytest
import torch
import torch.nn.functional as F

from mmpretrain.losses import LOSSES, build_objective

from ddp_helpers import run_ranks

B, D, E = 12, 16, 24


def inputs(seed=0, b=B, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = F.normalize(torch.randn(b, D, generator=g, dtype=dtype), dim=-1).requires_grad_()
    y = F.normalize(torch.randn(b, D, generator=g, dtype=dtype), dim=-1).requires_grad_()
    t = F.normalize(torch.randn(b, E, generator=g, dtype=dtype), dim=-1)
    return x, y, t


TOL = dict(rtol=1e-6, atol=1e-8)


def naive_soft_target(x, y, t, s, tau_s):
    """docs/methods.md: L = -1/(2B) sum_ij G_ij [log softmax_j(s x_i.y_j) + log softmax_j(s y_i.x_j)]."""
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
    s = torch.tensor(1 / 0.07, dtype=torch.float64)
    ours = LOSSES["clip"](local_loss=local_loss)(image_features=x, text_features=y, logit_scale=s)["clip_loss"]
    from open_clip.loss import ClipLoss as OpenClipLoss  # here: the 2-rank workers import this module

    ref = OpenClipLoss()(x, y, s)
    torch.testing.assert_close(ours, ref, **TOL)
    for a, b in zip(grads(ours, x, y), grads(ref, x, y)):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("within", [False, True])
def test_sigmoid_matches_open_clip_and_naive(within):
    x, y, _ = inputs(7)
    s, bias = torch.tensor(10.0, dtype=torch.float64), torch.tensor(-10.0, dtype=torch.float64)
    ours = LOSSES["sigmoid"](within_view_negatives=within)(image_features=x, text_features=y, logit_scale=s,
                                                           logit_bias=bias)["sigmoid_loss"]
    from open_clip.loss import SigLipLoss

    ref = SigLipLoss()(x, y, s, bias)
    if within:
        off = ~torch.eye(B, dtype=torch.bool)
        for a in (x, y):
            ref = ref - F.logsigmoid(-(s * a @ a.T + bias))[off].sum() / B
    torch.testing.assert_close(ours, ref, **TOL)
    for a, b in zip(grads(ours, x, y), grads(ref, x, y)):
        torch.testing.assert_close(a, b, **TOL)


def naive_cwcl(x, y, t, s):
    b = x.shape[0]
    total = 0.0
    for i in range(b):
        w = torch.stack([(1 + t[i] @ t[j]) / 2 for j in range(b)])
        li = torch.stack([s * x[i] @ y[j] for j in range(b)])
        total = total - (w * (li - torch.logsumexp(li, 0))).sum() / w.sum()
    l_i2t = total / b
    l_t2i = F.cross_entropy(s * y @ x.T, torch.arange(b))
    return (l_i2t + l_t2i) / 2


def naive_vrn(x, y, delta):
    b = x.shape[0]
    vals = [(x[i] @ y[j] - delta) ** 2 for i in range(b) for j in range(b) if i != j]
    return torch.stack(vals).mean()


def naive_align_uniform(x, y):
    b = x.shape[0]
    align = torch.stack([((x[i] - y[i]) ** 2).sum() for i in range(b)]).mean()

    def unif(z):
        return torch.log(torch.stack([torch.exp(-2 * ((z[i] - z[j]) ** 2).sum())
                                      for i in range(b) for j in range(b) if i != j]).mean())

    return align + (unif(x) + unif(y)) / 2


@pytest.mark.parametrize(
    "name, options, ref",
    [
        ("cwcl", {}, lambda x, y, t: naive_cwcl(x, y, t, 5.0)),
        ("vrn", {"dataset_size": 1000}, lambda x, y, t: naive_vrn(x, y, -1 / 999)),
        ("vrn", {"delta": 0.1}, lambda x, y, t: naive_vrn(x, y, 0.1)),
        ("align_uniform", {}, lambda x, y, t: naive_align_uniform(x, y)),
        ("soft_target", {"target_temperature": 0.3}, lambda x, y, t: naive_soft_target(x, y, t, 5.0, 0.3)),
    ],
)
def test_objective_equals_naive_reference_and_gradcheck(name, options, ref):
    x, y, t = inputs(11, b=6)
    fn = LOSSES[name](**options)

    def ours(x, y):
        return fn(image_features=x, text_features=y, logit_scale=5.0, target_embeddings=t)[f"{name}_loss"]

    torch.testing.assert_close(ours(x, y), ref(x, y, t), **TOL)
    assert torch.autograd.gradcheck(ours, (x, y))


def test_soft_target_matches_naive_and_reduces_to_clip():
    x, y, t = inputs(1)
    s, tau = 7.0, 0.3
    ours = LOSSES["soft_target"](target_temperature=tau)(
        image_features=x, text_features=y, logit_scale=s, target_embeddings=t)["soft_target_loss"]
    ref = naive_soft_target(x, y, t, s, tau)
    torch.testing.assert_close(ours, ref, **TOL)
    for a, b in zip(grads(ours, x, y), grads(ref, x, y)):
        torch.testing.assert_close(a, b, **TOL)
    # identical-caption-free targets at tiny tau: G -> I, the loss -> CLIP
    tiny = LOSSES["soft_target"](target_temperature=1e-4)(
        image_features=x, text_features=y, logit_scale=s, target_embeddings=t)["soft_target_loss"]
    clip = LOSSES["clip"]()(image_features=x, text_features=y, logit_scale=s)["clip_loss"]
    torch.testing.assert_close(tiny, clip, **TOL)


def test_soft_target_image_image_single_view_masks_diagonal():
    x, _, t = inputs(2)
    tau_s, temp = 0.5, 0.1
    ours = LOSSES["soft_target"](space="image_image", target_temperature=tau_s, temperature=temp)(
        image_features=x, text_features=x, logit_scale=1.0, target_embeddings=t)["soft_target_loss"]
    eye = torch.eye(B, dtype=torch.bool)
    g = (t @ t.T / tau_s).masked_fill(eye, -math.inf).softmax(1)
    logp = (x @ x.T / temp).masked_fill(eye, -math.inf).log_softmax(1)
    ref = -(g * logp.masked_fill(eye, 0)).sum(1).mean()
    torch.testing.assert_close(ours, ref, **TOL)
    torch.testing.assert_close(grads(ours, x)[0], grads(ref, x)[0], **TOL)


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


# ---------------------------------------------------------------- tiled == untiled

TILED = [
    ("clip", {}),
    ("clip", {"local_loss": True}),
    ("sigmoid", {}),
    ("sigmoid", {"within_view_negatives": True}),
    ("soft_target", {"target_temperature": 0.2}),
    ("soft_target", {"space": "image_image", "target_temperature": 0.2, "temperature": 0.2}),
]


@pytest.mark.parametrize("name, options", TILED)
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_tiled_equals_untiled(name, options, chunk):
    x, y, t = inputs(13)
    x2 = F.normalize(x.detach() + 0.1 * torch.randn_like(x), dim=-1).requires_grad_()
    s = torch.tensor(8.0, dtype=torch.float64, requires_grad=True)
    bias = torch.tensor(-3.0, dtype=torch.float64, requires_grad=True)

    def run(chunk_size):
        out = LOSSES[name](chunk_size=chunk_size, **options)(
            image_features=x, text_features=y, logit_scale=s, logit_bias=bias, target_embeddings=t,
            image_features_2=x2)[f"{name}_loss"]
        leaves = [v for v in (x, y, s, bias, x2) if v is not None]
        return out, torch.autograd.grad(out, leaves, allow_unused=True)

    full, g_full = run(None)
    tiled, g_tiled = run(chunk)
    torch.testing.assert_close(tiled, full, **TOL)
    for a, b in zip(g_tiled, g_full):
        if a is None or b is None:  # e.g. a bias that one form does not touch: its gradient is 0
            other = b if a is None else a
            assert other is None or abs(float(other)) < 1e-12
        else:
            torch.testing.assert_close(a, b, **TOL)


def test_tiled_gradcheck():
    x, y, t = inputs(17, b=7)
    for name, options in TILED[:5]:
        fn = LOSSES[name](chunk_size=3, **options)
        assert torch.autograd.gradcheck(
            lambda x, y, fn=fn, key=f"{name}_loss": fn(image_features=x, text_features=y, logit_scale=4.0,
                                                      logit_bias=-1.0, target_embeddings=t)[key], (x, y))


# ---------------------------------------------------------------- 2 gloo ranks

DIST_CASES = [
    ("clip", {}),
    ("clip", {"local_loss": True}),
    ("clip", {"gather_with_grad": False}),
    ("clip", {"chunk_size": 4}),
    ("clip", {"local_loss": True, "chunk_size": 5}),
    ("sigmoid", {}),
    ("sigmoid", {"within_view_negatives": True}),
    ("sigmoid", {"chunk_size": 4}),
    ("soft_target", {"target_temperature": 0.2}),
    ("soft_target", {"target_temperature": 0.2, "chunk_size": 4}),
    ("soft_target", {"space": "image_image", "target_temperature": 0.2}),
    ("cwcl", {}),
    ("vrn", {"dataset_size": 50}),
    ("align_uniform", {}),
]


def _loss_and_grads(name, options, x, y, t, **ctor):
    """The loss and its gradients for the features, the logit scale and the bias (model parameters)."""
    scale = torch.tensor(9.0, dtype=torch.float64, requires_grad=True)
    bias = torch.tensor(-2.0, dtype=torch.float64, requires_grad=True)
    out = LOSSES[name](**ctor, **options)(
        image_features=x, text_features=y, logit_scale=scale, logit_bias=bias, target_embeddings=t)[f"{name}_loss"]
    leaves = (x, y, scale, bias)
    g = torch.autograd.grad(out, leaves, allow_unused=True)
    return out.detach(), *(torch.zeros_like(v) if gi is None else gi for gi, v in zip(g, leaves))


def _rank_losses(rank, world):
    x, y, t = inputs(5, b=B)  # the same global batch on every rank; each takes its slice
    b = B // world
    sl = slice(rank * b, (rank + 1) * b)
    results = []
    for name, options in DIST_CASES:
        xl = x.detach()[sl].clone().requires_grad_()
        yl = y.detach()[sl].clone().requires_grad_()
        results.append(_loss_and_grads(name, options, xl, yl, t[sl], rank=rank, world_size=world))
    return results


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    """``world -> every case's results`` on 2 or 4 gloo ranks (B = 12: 6 or 3 samples per rank), each world
    run once, when a test first asks for it."""
    done = {}

    def results(world: int) -> list:
        if world not in done:
            done[world] = run_ranks(_rank_losses, (), tmp_path_factory.mktemp(f"ddp{world}"), world=world)
        return done[world]

    return results


# 4 ranks: a pool of 4 more processes, so not in make test-unit (2 ranks are)
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.integration)])
@pytest.mark.parametrize("case", range(len(DIST_CASES)), ids=[f"{n}-{o}" for n, o in DIST_CASES])
def test_ranks_equal_one_process(rank_results, case, world):
    name, options = DIST_CASES[case]
    x, y, t = inputs(5)
    full, gx, gy, gs, gb = _loss_and_grads(name, options, x, y, t)
    res = [r[case] for r in rank_results(world)]
    # mean over ranks of the losses == the one-process loss
    torch.testing.assert_close(torch.stack([r[0] for r in res]).mean(), full, **TOL)
    # DDP averages parameter gradients over ranks, so rank r's feature gradient / world must equal
    # the one-process gradient of its slice
    torch.testing.assert_close(torch.cat([r[1] for r in res]) / world, gx, **TOL)
    torch.testing.assert_close(torch.cat([r[2] for r in res]) / world, gy, **TOL)
    # every parameter, not only the features: DDP's average of the scale's and bias's gradients
    torch.testing.assert_close(torch.stack([r[3] for r in res]).mean(), gs, **TOL)
    torch.testing.assert_close(torch.stack([r[4] for r in res]).mean(), gb, **TOL)
