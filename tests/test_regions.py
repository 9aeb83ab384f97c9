"""Region weighting (AMA) against naive references: scales=[1] is the base objective, the restricted
(in-region) denominator, the Hedge update, the simplex, the warm-up, state through a checkpoint, and
2 gloo ranks agreeing with each other and with one process."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mmpretrain.losses import LOSSES, build_objective
from mmpretrain.losses.regions import hedge_update

from ddp_helpers import run_ranks

D, E = 16, 24
S = torch.tensor(10.0, dtype=torch.float64)
TOL = dict(rtol=1e-6, atol=1e-9)


def feats(b, seed):
    g = torch.Generator().manual_seed(seed)
    x = F.normalize(torch.randn(b, D, generator=g, dtype=torch.float64), dim=-1).requires_grad_()
    y = F.normalize(torch.randn(b, D, generator=g, dtype=torch.float64), dim=-1).requires_grad_()
    t = F.normalize(torch.randn(b, E, generator=g, dtype=torch.float64), dim=-1)
    return x, y, t


def naive_clip(x, y, s):
    """Symmetric InfoNCE written per row: -log softmax over the given rows only."""
    n = x.shape[0]
    total = 0.0
    for i in range(n):
        li = torch.stack([s * x[i] @ y[j] for j in range(n)])
        lt = torch.stack([s * y[i] @ x[j] for j in range(n)])
        total = total - (li[i] - torch.logsumexp(li, 0)) - (lt[i] - torch.logsumexp(lt, 0))
    return total / (2 * n)


def clustered_batch(seed=0):
    """13 samples: 6 near e0, 6 near e1, 1 near e2, none near e3 (regions of 6, 6, 1, 0)."""
    g = torch.Generator().manual_seed(seed)
    e = torch.eye(D, dtype=torch.float64)[:4]
    rows = [e[0]] * 6 + [e[1]] * 6 + [e[2]]
    x = F.normalize(torch.stack(rows) + 0.05 * torch.randn(13, D, generator=g, dtype=torch.float64), dim=-1)
    y = F.normalize(x.detach() + 0.5 * torch.randn(13, D, generator=g, dtype=torch.float64), dim=-1)
    return x.requires_grad_(), y.requires_grad_(), e


def with_centroids(module, centroids):
    """Fix the regions (as if just clustered) so that the test knows them; no refresh follows."""
    for j, c in enumerate(centroids):
        setattr(module, f"centroids_{j}", c.float())
    module.last_refresh.fill_(0)
    module._last_refresh = 0  # the host copy the step decides from
    return module


@pytest.mark.parametrize("base", ["clip", "sigmoid", "soft_target"])
def test_one_region_equals_the_base_objective(base):
    x, y, t = feats(12, 1)
    bias = torch.tensor(-5.0, dtype=torch.float64) if base == "sigmoid" else None
    module = LOSSES["regions"](base=base, scales=[1], bank_size=64)
    out = module(image_features=x, text_features=y, target_embeddings=t, logit_scale=S, logit_bias=bias, step=0)
    assert out["regions/active"] == 1  # clustered on the first call (12 >= min bank of 10)
    ref = LOSSES[base]()(image_features=x, text_features=y, target_embeddings=t, logit_scale=S,
                         logit_bias=bias)[f"{base}_loss"]
    torch.testing.assert_close(out["regions_loss"], ref, **TOL)
    for a, b in zip(torch.autograd.grad(out["regions_loss"], (x, y)), torch.autograd.grad(ref, (x, y))):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("masked", [True, False], ids=["one-masked-pass", "per-region-calls"])
def test_region_loss_uses_only_in_region_negatives_and_the_previous_weights(masked):
    x, y, e = clustered_batch()
    module = with_centroids(LOSSES["regions"](scales=[1, 4], bank_size=64, refresh_every=10**6, eta0=0.3),
                            [x.detach().mean(0, keepdim=True), e])
    assert module._masked_clip  # clip's default path
    module._masked_clip = masked
    assign = torch.cdist(x.detach(), e).argmin(1)
    assert torch.bincount(assign, minlength=4).tolist() == [6, 6, 1, 0]

    def naive(q4):
        members = [torch.nonzero(assign == r).flatten() for r in range(4)]
        local = [naive_clip(x[m], y[m], S) for m in members[:2]]  # regions 2 (1 sample) and 3 (empty) skipped
        w = q4[:2] / q4[:2].sum()
        whole = naive_clip(x, y, S)
        return (whole + whole + w[0] * local[0] + w[1] * local[1]) / 3, torch.stack(local)

    for step, epoch in ((0, 1), (1, 2)):
        q_before = module.q(1).clone()
        out = module(image_features=x, text_features=y, logit_scale=S, step=step, epoch=epoch)
        ref, local = naive(q_before)  # the step uses the weights from before its own update
        torch.testing.assert_close(out["regions_loss"], ref, **TOL)
        for a, b in zip(torch.autograd.grad(out["regions_loss"], (x, y)), torch.autograd.grad(ref, (x, y))):
            torch.testing.assert_close(a, b, **TOL)
        assert out["regions/m4/skipped"] == 2 and out["regions/m4/sizes"].tolist() == [6, 6, 1, 0]
        # Hedge: q_r <- q_r exp(eta L_r) / Z over the present regions, eta = eta0 / epoch; absent keep q_r
        eta = 0.3 / epoch
        mass = q_before[:2].sum()
        upd = q_before[:2] * torch.exp(eta * local.detach())
        expected = torch.cat([upd / upd.sum() * mass, q_before[2:]])
        torch.testing.assert_close(module.q(1), expected, rtol=1e-6, atol=1e-12)
        torch.testing.assert_close(out["regions/m4/losses"][:2], local.detach().float(), rtol=1e-5, atol=1e-6)
        assert not torch.equal(module.q(1), q_before)


def test_hedge_keeps_weights_on_the_simplex():
    g = torch.Generator().manual_seed(3)
    log_q = torch.full((7,), -math.log(7), dtype=torch.float64)
    for _ in range(500):
        losses = torch.rand(7, generator=g, dtype=torch.float64) * 50
        present = torch.rand(7, generator=g) > 0.3
        if present.any():
            log_q = hedge_update(log_q, losses, present, eta=2.0)
    q = log_q.exp()
    assert torch.isfinite(log_q).all() and (q >= 0).all()
    torch.testing.assert_close(q.sum(), torch.tensor(1.0, dtype=torch.float64))
    # and through the module, many steps with a large step size
    module = LOSSES["regions"](scales=[3, 5], bank_size=64, refresh_every=3, eta0=5.0)
    for step in range(12):
        x, y, _ = feats(24, 100 + step)
        module(image_features=x, text_features=y, logit_scale=S, step=step)
        for j in range(2):
            q = module.q(j)
            assert (q >= 0).all() and abs(float(q.sum()) - 1) < 1e-9


def test_warmup_uses_only_the_global_term():
    x, y, t = feats(16, 2)
    base = LOSSES["clip"]()(image_features=x, text_features=y, logit_scale=S)["clip_loss"]
    module = LOSSES["regions"](scales=[2, 4], bank_size=64, warmup_steps=3, warmup_epochs=1)
    for step, epoch in ((0, 1), (2, 2), (5, 1)):  # warm-up by steps, then by epochs
        out = module(image_features=x, text_features=y, logit_scale=S, step=step, epoch=epoch)
        assert out["regions/active"] == 0 and torch.equal(out["regions_loss"], base)
        assert torch.equal(module.q(1), torch.full((4,), 0.25, dtype=torch.float64))
    out = module(image_features=x, text_features=y, logit_scale=S, step=5, epoch=2)
    assert out["regions/active"] == 1 and not torch.allclose(out["regions_loss"], base)
    assert not torch.equal(module.q(1), torch.full((4,), 0.25, dtype=torch.float64))


def test_state_survives_a_checkpoint(tmp_path):
    options = dict(scales=[2, 3], bank_size=40, refresh_every=2, space="target")
    a = build_objective([{"name": "regions", "options": options}])
    labels = torch.arange(16) % 3
    for step in range(5):
        x, y, t = feats(16, step)
        a(image_features=x, text_features=y, target_embeddings=t, logit_scale=S, step=step, labels=labels)
    torch.save(a.state_dict(), tmp_path / "state.pt")
    b = build_objective([{"name": "regions", "options": options}])
    b.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    for step in range(5, 9):  # includes re-clusterings warm-started from the restored centroids
        x, y, t = feats(16, step)
        oa = a(image_features=x, text_features=y, target_embeddings=t, logit_scale=S, step=step, labels=labels)
        ob = b(image_features=x, text_features=y, target_embeddings=t, logit_scale=S, step=step, labels=labels)
        assert torch.equal(oa["regions_loss"], ob["regions_loss"])
        assert 0 < float(oa["regions/m3/purity"]) <= 1
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="base="):
        LOSSES["regions"](base="regions")
    with pytest.raises(ValueError, match="scales"):
        LOSSES["regions"](scales=[])
    with pytest.raises(ValueError, match="queue_size needs base=clip"):
        LOSSES["regions"](base="sigmoid", queue_size=16)
    x, y, _ = feats(12, 0)
    with pytest.raises(ValueError, match="space=target needs target_embeddings"):
        LOSSES["regions"](space="target")(image_features=x, text_features=y, logit_scale=S)


def test_queue_adds_in_region_negatives():
    module = LOSSES["regions"](scales=[1], bank_size=64, queue_size=8)
    x0, y0, _ = feats(12, 5)
    module(image_features=x0, text_features=y0, logit_scale=S, step=0)
    x, y, _ = feats(12, 6)
    out = module(image_features=x, text_features=y, logit_scale=S, step=1)
    qx, qy = x0.detach()[-8:], y0.detach()[-8:]  # the queue: the last 8 of the previous batch, one region
    labels = torch.arange(12)
    local = 0.5 * (F.cross_entropy(S * x @ torch.cat([y, qy]).T, labels)
                   + F.cross_entropy(S * y @ torch.cat([x, qx]).T, labels))
    ref = (naive_clip(x, y, S) + local) / 2
    torch.testing.assert_close(out["regions_loss"], ref, **TOL)


def _ranks(rank, world, steps, b, masked=True):
    module = LOSSES["regions"](scales=[2, 3], bank_size=48, refresh_every=2, rank=rank, world_size=world)
    module._masked_clip = masked
    res = []
    for step in range(steps):
        x, y, _ = feats(world * b, step)
        xs = x.detach()[rank * b:(rank + 1) * b].clone().requires_grad_()
        ys = y.detach()[rank * b:(rank + 1) * b].clone().requires_grad_()
        out = module(image_features=xs, text_features=ys, logit_scale=S, step=step)
        gx, gy = torch.autograd.grad(out["regions_loss"], (xs, ys))
        res.append((out["regions_loss"].detach(), gx, gy))
    return res, {k: v.clone() for k, v in module.state_dict().items()}


def _both_paths(rank, world, steps, b):
    return [_ranks(rank, world, steps, b, masked) for masked in (True, False)]


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    return run_ranks(_both_paths, (5, 8), tmp_path_factory.mktemp("ddp_regions"), world=2)


@pytest.mark.parametrize("path", [0, 1], ids=["one-masked-pass", "per-region-calls"])
def test_two_ranks_agree_with_each_other_and_with_one_process(two_rank_runs, path):
    steps, b = 5, 8
    (r0, s0), (r1, s1) = two_rank_runs[0][path], two_rank_runs[1][path]
    (one, s), = [_ranks(0, 1, steps, 2 * b, masked=path == 0)]
    # clustered at step 1 (32 samples banked), re-clustered at 3: same centroids, weights and bank on both
    # ranks, and as one process
    for k in s:
        assert torch.equal(s0[k], s1[k]), k
        torch.testing.assert_close(s0[k], s[k], rtol=1e-5, atol=1e-6)
    assert float(s["last_refresh"]) == 3 and not torch.equal(s["log_q_1"], torch.full((3,), -math.log(3)).double())
    for (l0, gx0, gy0), (l1, gx1, gy1), (loss, gx, gy) in zip(r0, r1, one):
        torch.testing.assert_close((l0 + l1) / 2, loss, **TOL)
        # DDP averages parameter gradients: each rank's feature gradient / 2 is the one-process gradient
        torch.testing.assert_close(torch.cat([gx0, gx1]) / 2, gx, **TOL)
        torch.testing.assert_close(torch.cat([gy0, gy1]) / 2, gy, **TOL)


def test_the_masked_pass_in_row_tiles_builds_no_batch_square_and_equals_one_tile(monkeypatch):
    """The masked pass (every region of a scale at once) in tiles of 4 rows against the 64-sample batch:
    the largest product is 4 x 64, not 64 x 64, and value and gradient equal the single-tile pass and
    the per-region reference; the tiles are recomputed in the backward, not kept."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from mmpretrain.losses import region_math as regions

    x, y, _ = feats(64, 5)
    assign = torch.arange(64) % 5
    sizes = F.one_hot(assign, 5).sum(0)
    whole = regions.masked_clip_regions(x, y, S, assign, sizes)
    gx, gy = torch.autograd.grad(whole.sum(), (x, y))

    class Shapes(TorchDispatchMode):
        """The shapes of every tensor any operator makes, forward and backward."""

        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for o in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(o, torch.Tensor):
                    self.seen.add(tuple(o.shape))
            return out

    with Shapes() as one_tile:
        torch.autograd.grad(regions.masked_clip_regions(x, y, S, assign, sizes).sum(), (x, y))
    assert (64, 64) in one_tile.seen  # the batch square, which the tiles avoid
    monkeypatch.setattr(regions, "TILE_ELEMENTS", 256)
    assert regions.tile_rows(64) == 4
    with Shapes() as tiles:
        tiled = regions.masked_clip_regions(x, y, S, assign, sizes)
        tx, ty = torch.autograd.grad(tiled.sum(), (x, y))
    # tiles of 4 rows against the 64 columns; no logits of more rows ((16, 64) is y.T, D x N; (5, 64)
    # the one-hot of the 5 regions, m x N)
    assert (4, 64) in tiles.seen and not {(n, 64) for n in range(6, 65) if n != D} & tiles.seen
    torch.testing.assert_close(tiled, whole, **TOL)
    torch.testing.assert_close(tx, gx, **TOL)
    torch.testing.assert_close(ty, gy, **TOL)
    for r in range(5):  # each region: the base objective over its own rows and columns
        idx = torch.nonzero(assign == r).flatten()
        torch.testing.assert_close(whole[r], naive_clip(x[idx], y[idx], S), **TOL)


def test_purity_counts_each_regions_most_frequent_label():
    from mmpretrain.losses.region_math import purity as _purity

    assign = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    labels = torch.tensor([5, 5, 7, 1, -1, 3, 4, 3])  # region 0: 2 of 3, region 1: 1 of 1 known, region 2: 2 of 3
    assert _purity(assign, labels, 4).item() == pytest.approx(5 / 7)
    assert math.isnan(_purity(assign, torch.full((8,), -1), 4).item())
