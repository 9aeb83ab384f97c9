"""Adaptive multi-scale region weighting (AMA, NeurIPS 2025) around any base objective.

For each scale ``s = 1..S`` the embedding space is cut into ``m_s`` regions by k-means on a bank of
recent detached embeddings (``space="image"``: the normalised image features, as in the paper;
``space="target"``: the frozen caption embeddings, which do not drift). Every sample of the gathered
batch goes to its nearest centroid. The local loss of region ``R`` is the base objective on the
region's sub-graph only (the paper's Eq. 12): positives and every normalising negative from inside
``R``, never the whole batch's denominator (Eq. 13, measurably worse, is not implemented).
Per scale, weights ``q^s`` on the simplex follow the Hedge update

    q_r <- q_r exp(eta_t L_s(R_r)) / Z,      eta_t = eta0 / epoch   (epochs count from 1)

applied after the step's losses are known, so step ``t`` uses the ``q`` of step ``t-1``; weights are
constants for backward. The objective is

    L = 1/(S+1) [ L_0 + sum_s sum_r q_r^s L_s(R_r^s) ]

with ``L_0`` the base objective on the whole batch (computed in the base's own distributed form), so
``scales=[1]`` equals the base objective. During the warm-up (``warmup_steps``/``warmup_epochs``)
the objective is ``L_0`` alone; the bank fills and the regions are clustered (and their sizes and
purity logged) but no region loss is computed.

Decisions the paper leaves open (methods.md):

* Regions with fewer than 2 samples of the gathered batch have no loss: they are skipped and counted,
  the scale's weights are renormalised over the regions present (so every scale weighs 1 and a
  skipped region's share is not silently lost), and only the present regions' weights are updated,
  keeping their total mass (an absent region is neither rewarded nor penalised).
* Weights are kept as log-weights (``log_q_<j>``): the same Hedge iterate, but a region whose weight
  would underflow to 0 in ``q`` can still recover, as Hedge intends.
* Region identities survive re-clustering: k-means is warm-started from the previous centroids and the
  new centroids are matched to the old by a minimum-distance assignment (Hungarian), so ``q``
  carries over to the region that continues it. Resetting ``q`` to uniform at every refresh would
  discard the Hedge state every ``refresh_every`` steps.
* k-means is scikit-learn's (Lloyd, ``n_init=1``, 20 iterations), chosen by measurement on this
  2-core machine (unit vectors, medians of 3): a 4,096 x 512 bank into 20 regions takes 261 ms from
  k-means++ and 23 ms warm-started (faiss-cpu 1.15: 101 ms, from scratch); a 16,384 x 1,024 bank
  (the CC3M recipe) 1.56 s / 0.43 s (faiss 0.64 s). Warm starts are the steady state here, so
  scikit-learn (already a dependency of the evaluation) is the faster choice and faiss is not
  added. Rank 0 clusters and broadcasts centroids and weights, so every rank holds identical ones.

Distributed: the region losses are computed on the gathered batch (features gathered with gradient)
and have the same value on every rank, like clip's global form; the all-gather's backward sums the
ranks' gradients, so with DDP averaging the gradient equals one process holding the whole batch.

On a GPU with ``base="clip"`` (no queue, no ``chunk_size``) a step reads nothing on the host: every
region of a scale comes from one masked pass in row tiles (no ``B x B`` matrix above a gathered batch
of 4,096: :data:`~mmpretrain.losses.region_math.TILE_ELEMENTS`), sizes and weights stay on the device, the bank's pointer is kept on
the host as well, and only a re-clustering step (k-means on the host) reads. Other bases, a queue or
tiles take one call per present region, which reads the regions present (a sync a step).

``queue_size > 0`` (``base="clip"`` only) keeps a queue of past detached image and text embeddings;
queue entries in a region add in-region negatives (columns) to that region's loss. Off by default.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mmpretrain.losses.base import Objective, total_of
from mmpretrain.losses.clusters import kmeans, match, nearest
from mmpretrain.losses.distributed import gather_no_grad, gather_with_grad
from mmpretrain.losses.region_math import hedge_update, masked_clip_regions, one_hot, purity, tile_rows
from mmpretrain.losses.registry import OBJECTIVES

# The masked pass costs O(S * N^2) elementwise work in a few kernels, the per-region calls
# O(N^2 * sum_s 1/m_s) in ~sum_s m_s small calls. On a GPU the few kernels win at any batch; on the
# 2-core AMD EPYC (scales [5, 10, 20], D 512, forward + backward, the row-tiled pass) the masked pass
# took 6.8 ms against 9.9 ms at N = 128, 13.2 against 12.6 at 256, 44 against 24 at 512 and 166
# against 53 at 1,024, so on a CPU it is used up to this gathered batch size.
MASKED_CPU_MAX = 256
class RegionLoss(Objective):
    """``LOSSES["regions"]``: see the module docstring. Options:

    ``base`` (a name in ``LOSSES``) and ``base_options``; ``scales`` (region counts, default
    ``[5, 10, 20]``); ``space`` (``image`` | ``target``); ``bank_size`` (recent samples k-means runs
    on); ``refresh_every`` (steps between re-clusterings); ``kmeans_iters``; ``eta0``;
    ``warmup_steps`` / ``warmup_epochs`` (global objective only while ``step < warmup_steps`` or
    ``epoch <= warmup_epochs``); ``queue_size``; ``seed``.

    Forward keywords besides the base's: ``step`` (the optimizer step, from 0; default: calls so
    far), ``epoch`` (counted from 1; default 1), ``labels (B,)`` (ints, ``-1`` = unknown; only for
    the purity diagnostic).
    """

    name = "regions"

    whole_batch = True  # regions and Hedge weights are of the whole (gathered) batch

    @property
    def needs(self) -> frozenset[str]:
        """The global term's, labels (the purity diagnostic) and the targets when it clusters in their space."""
        return self.global_term.needs | {"labels"} | ({"targets"} if self.space == "target" else set())

    @property
    def uses_logit_scale(self) -> bool:
        return self.global_term.uses_logit_scale

    @property
    def uses_logit_bias(self) -> bool:
        return self.global_term.uses_logit_bias

    def __init__(
        self,
        *,
        base: str = "clip",
        base_options: dict[str, Any] | None = None,
        scales: Sequence[int] = (5, 10, 20),
        space: Literal["image", "target"] = "image",
        bank_size: int = 4096,
        refresh_every: int = 100,
        kmeans_iters: int = 20,
        eta0: float = 0.1,
        warmup_steps: int = 0,
        warmup_epochs: int = 0,
        queue_size: int = 0,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        chunk_size: int | None = None,
    ):
        super().__init__(rank=rank, world_size=world_size)  # chunk_size: the base's (checked by it)
        if base not in OBJECTIVES:
            raise ValueError(f"regions: base={base!r}; choose one of {sorted(OBJECTIVES)}")
        scales = [int(m) for m in scales]
        if not scales or min(scales) < 1:
            raise ValueError(f"regions: scales={scales} must be a non-empty list of region counts >= 1")
        if space not in ("image", "target"):
            raise ValueError(f"regions: space must be 'image' or 'target', got {space!r}")
        if bank_size < max(scales) or refresh_every < 1 or kmeans_iters < 1:
            raise ValueError(f"regions: need bank_size >= max(scales) ({max(scales)}), refresh_every >= 1 and "
                             f"kmeans_iters >= 1 (got {bank_size}, {refresh_every}, {kmeans_iters})")
        if eta0 < 0 or warmup_steps < 0 or warmup_epochs < 0 or queue_size < 0:
            raise ValueError("regions: eta0, warmup_steps, warmup_epochs and queue_size must be >= 0")
        if queue_size and base != "clip":
            raise ValueError(f"regions: queue_size needs base=clip (the queue adds InfoNCE negatives), got base={base!r}")
        base_options = dict(base_options or {})
        if base_options.get("hard_negatives"):
            raise ValueError("regions: base_options.hard_negatives is not offered inside the region wrapper (its "
                             "region terms see subsets of the batch); add the base objective with hard_negatives "
                             "as its own loss term beside regions")
        self.base = base
        self.global_term = OBJECTIVES[base](rank=rank, world_size=world_size, chunk_size=chunk_size, **base_options)
        local_options = {k: v for k, v in base_options.items() if k not in ("local_loss", "gather_with_grad")}
        self.local_term = OBJECTIVES[base](rank=0, world_size=1, chunk_size=chunk_size, **local_options)
        self.init_logit_scale = self.global_term.init_logit_scale
        self.init_logit_bias = self.global_term.init_logit_bias
        self.scales, self.space = scales, space
        self.bank_size, self.refresh_every, self.kmeans_iters = bank_size, refresh_every, kmeans_iters
        self.eta0, self.warmup_steps, self.warmup_epochs = eta0, warmup_steps, warmup_epochs
        self.queue_size, self.seed = queue_size, seed
        self.min_bank = min(bank_size, 10 * max(scales))
        # clip without a queue or tiles: every region of a scale from one masked B x B pass (equal to the
        # per-region calls, tested) instead of one call per region; see MASKED_CPU_MAX
        self._masked_clip = base == "clip" and not queue_size and chunk_size is None
        for j, m in enumerate(scales):
            self.register_buffer(f"log_q_{j}", torch.full((m,), -math.log(m), dtype=torch.float64))
            self.register_buffer(f"centroids_{j}", torch.empty(0))
        self.register_buffer("bank", torch.empty(0))
        self.register_buffer("bank_ptr", torch.zeros((), dtype=torch.long))
        self.register_buffer("bank_count", torch.zeros((), dtype=torch.long))
        self.register_buffer("last_refresh", torch.full((), -1, dtype=torch.long))
        self.register_buffer("steps_seen", torch.zeros((), dtype=torch.long))
        # host copies of the bank's pointer and count and of the last refresh step: the step decides
        # when to re-cluster from them without reading the device (set again from a loaded state)
        self._bank_ptr = self._bank_count = 0
        self._last_refresh = -1
        if queue_size:
            for name in ("queue_image", "queue_text", "queue_key"):
                self.register_buffer(name, torch.empty(0))
            self.register_buffer("queue_ptr", torch.zeros((), dtype=torch.long))
            self.register_buffer("queue_count", torch.zeros((), dtype=torch.long))

    # ------------------------------------------------------------------------------------------ state

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # bank, centroids and queue are sized on first use: adopt the saved shapes
        for name, buf in self._buffers.items():
            saved = state_dict.get(prefix + name)
            if buf is not None and saved is not None and buf.shape != saved.shape:
                self._buffers[name] = torch.empty(saved.shape, dtype=saved.dtype, device=buf.device)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        for name in ("bank_ptr", "bank_count", "last_refresh"):  # once, at load: the step reads its host copies
            if prefix + name in state_dict:
                setattr(self, f"_{name}", int(state_dict[prefix + name]))

    def q(self, j: int) -> torch.Tensor:
        """The weights of scale ``j`` (index into ``scales``) on the simplex."""
        return getattr(self, f"log_q_{j}").exp()

    def centroids(self, j: int) -> torch.Tensor:
        return getattr(self, f"centroids_{j}")

    @property
    def clustered(self) -> bool:
        return self.centroids(0).numel() > 0

    def _ring(self, name: str, rows: torch.Tensor, size: int) -> None:
        buf = getattr(self, name)
        if buf.numel() == 0:
            buf = torch.zeros(size, rows.shape[1], dtype=torch.float32, device=rows.device)
            setattr(self, name, buf)
        ptr = self.bank_ptr if name == "bank" else self.queue_ptr
        rows = rows[-size:].to(buf)
        idx = (int(ptr) + torch.arange(rows.shape[0], device=buf.device)) % size
        buf[idx] = rows

    def _push(self, key: torch.Tensor) -> None:
        """The batch's keys into the bank's ring, positions from the host copy of its pointer."""
        buf = self.bank
        if buf.numel() == 0:
            buf = self.bank = torch.zeros(self.bank_size, key.shape[1], dtype=torch.float32, device=key.device)
        rows = key[-self.bank_size:].to(buf)
        n = rows.shape[0]
        idx = (self._bank_ptr + torch.arange(n, device=buf.device)) % self.bank_size
        buf[idx] = rows
        self._bank_ptr = (self._bank_ptr + n) % self.bank_size
        self._bank_count = min(self._bank_count + n, self.bank_size)
        self.bank_ptr.fill_(self._bank_ptr)
        self.bank_count.fill_(self._bank_count)

    def _push_queue(self, x: torch.Tensor, y: torch.Tensor, key: torch.Tensor) -> None:
        for name, rows in (("queue_image", x), ("queue_text", y), ("queue_key", key)):
            self._ring(name, rows, self.queue_size)
        n = min(x.shape[0], self.queue_size)
        self.queue_ptr.fill_((int(self.queue_ptr) + n) % self.queue_size)
        self.queue_count.fill_(min(int(self.queue_count) + n, self.queue_size))

    def _refresh(self, step: int) -> None:
        """Re-cluster the bank at every scale (rank 0) and give every rank the same centroids and weights."""
        bank = self.bank[: self._bank_count]
        for j, m in enumerate(self.scales):
            old = self.centroids(j)
            if self.rank == 0:
                new = kmeans(bank, m, old if old.numel() else None, self.kmeans_iters, self.seed + step)
                if old.numel():
                    new = match(old, new)
            else:
                new = torch.empty(m, bank.shape[1], dtype=bank.dtype, device=bank.device)
            setattr(self, f"centroids_{j}", new)
        if self.world_size > 1:
            for j in range(len(self.scales)):
                dist.broadcast(self.centroids(j), src=0)
                dist.broadcast(getattr(self, f"log_q_{j}"), src=0)
        self._last_refresh = step
        self.last_refresh.fill_(step)

    # ---------------------------------------------------------------------------------------- forward

    def largest_matrix(self, batch: int) -> int:
        """The base objective's, or the region terms' logits: a row tile of the masked pass (the gathered
        batch squared up to 4,096, then ``region_math.TILE_ELEMENTS``); on a CPU above :data:`MASKED_CPU_MAX`
        each region's own rows and columns (a region's size squared)."""
        gathered = batch * self.world_size
        return max(self.global_term.largest_matrix(batch), gathered * tile_rows(gathered))

    def forward(
        self,
        *,
        image_features: torch.Tensor,
        text_features: torch.Tensor,
        logit_scale: torch.Tensor | float,
        logit_bias: torch.Tensor | None = None,
        target_embeddings: torch.Tensor | None = None,
        step: int | None = None,
        epoch: int | float | None = None,
        labels: torch.Tensor | None = None,
        **extra,
    ) -> dict[str, torch.Tensor]:
        if extra.get("image_features_2") is not None:
            raise ValueError("regions: a second image view (image_features_2) is not supported; use one view")
        if self.bank_ptr.device != image_features.device:
            self.to(image_features.device)
        step = int(self.steps_seen) if step is None else int(step)
        epoch = 1 if epoch is None else max(1, int(epoch))
        self.steps_seen += 1
        base_in = dict(logit_scale=logit_scale, logit_bias=logit_bias)
        global_loss = total_of(self.global_term(image_features=image_features, text_features=text_features,
                                                   target_embeddings=target_embeddings, **base_in, **extra))
        out: dict[str, torch.Tensor] = {"regions/global": global_loss.detach()}
        if self.space == "target" and target_embeddings is None:
            raise ValueError("regions: space=target needs target_embeddings (frozen caption embeddings): run "
                             "`data_tools embed` on the shards or set targets.source=online")
        W = self.world_size
        all_x = gather_with_grad(image_features, W)
        all_y = gather_with_grad(text_features, W)
        all_t = None if target_embeddings is None else gather_no_grad(target_embeddings.detach(), W)
        with torch.no_grad():
            key = F.normalize((all_x if self.space == "image" else all_t).detach().float(), dim=-1)
            all_labels = None if labels is None else gather_no_grad(labels.to(key.device).long(), W)
            finite = torch.isfinite(key).all(1)
            # a row whose features are not finite enters the bank as zeros (the trainer skips such a
            # step's update); dropping it would need its count on the host
            self._push(key.masked_fill(~finite[:, None], 0.0))
            due = (not self.clustered and self._bank_count >= self.min_bank) or (
                self.clustered and step - self._last_refresh >= self.refresh_every)
            if due:
                self._refresh(step)
        warm = step < self.warmup_steps or epoch <= self.warmup_epochs
        active = self.clustered and not warm
        out["regions/active"] = torch.tensor(float(active))
        if not self.clustered:
            return {"regions_loss": global_loss, **out}
        eta = self.eta0 / epoch
        scale_terms = []
        for j, m in enumerate(self.scales):
            with torch.no_grad():
                assign = nearest(key, self.centroids(j).to(key))
                sizes = one_hot(assign, m).sum(0)  # bincount would read its largest value on the host
            present = sizes >= 2
            tag = f"regions/m{m}"
            # diagnostics stay on the device: the trainer copies them to the host on logging steps only
            out[f"{tag}/sizes"] = sizes.detach()
            out[f"{tag}/skipped"] = (~present).sum().float()
            if all_labels is not None:
                out[f"{tag}/purity"] = purity(assign, all_labels, m)
            masked = self._masked_clip and (all_x.is_cuda or all_x.shape[0] <= MASKED_CPU_MAX)
            if active and masked:  # every region of the scale in row tiles, nothing read on the host
                every = masked_clip_regions(all_x, all_y, base_in["logit_scale"], assign, sizes)
                losses = every.detach().masked_fill(~present, 0.0)
                weights = self.q(j).masked_fill(~present, 0.0)
                weights = (weights / weights.sum().clamp_min(1e-300)).to(global_loss.dtype)
                scale_terms.append((weights * every.masked_fill(~present, 0.0)).sum())
                with torch.no_grad():
                    log_q = getattr(self, f"log_q_{j}")
                    log_q.copy_(torch.where(torch.isfinite(losses).all(), hedge_update(
                        log_q, losses.to(log_q.dtype), present, eta), log_q))
            elif active and bool(present.any()):  # one call per region: its rows and columns only
                losses = torch.zeros(m, dtype=global_loss.dtype, device=global_loss.device)
                parts = []
                for r in torch.nonzero(present).flatten().tolist():
                    idx = torch.nonzero(assign == r).flatten()
                    loss_r = self._local(all_x, all_y, all_t, idx, r, j, base_in)
                    parts.append(loss_r)
                    losses[r] = loss_r.detach()
                weights = self.q(j)[present]
                weights = (weights / weights.sum()).to(global_loss.dtype)
                scale_terms.append((weights * torch.stack(parts)).sum())
                with torch.no_grad():
                    if torch.isfinite(losses).all():
                        log_q = getattr(self, f"log_q_{j}")
                        log_q.copy_(hedge_update(log_q, losses.to(log_q.dtype), present, eta))
            q = self.q(j)
            if active and masked:
                out[f"{tag}/losses"] = losses.float()
            elif active:
                out[f"{tag}/losses"] = losses.float() if bool(present.any()) else torch.zeros(m)
            out[f"{tag}/q_entropy"] = -(q * q.clamp_min(1e-300).log()).sum().float()
            out[f"{tag}/q_max"] = q.max().float()
        if self.queue_size:
            with torch.no_grad():
                ok = finite & torch.isfinite(all_x).all(1) & torch.isfinite(all_y).all(1)
                self._push_queue(all_x.detach()[ok].float(), all_y.detach()[ok].float(), key[ok])
        if not active:
            return {"regions_loss": global_loss, **out}
        total = (global_loss + sum(scale_terms)) / (len(self.scales) + 1)
        return {"regions_loss": total, **out}

    def _local(self, all_x, all_y, all_t, idx, r, j, base_in) -> torch.Tensor:
        """The base objective on region ``r``'s sub-graph (its samples' rows and columns only)."""
        x, y = all_x[idx], all_y[idx]
        t = None if all_t is None else all_t[idx]
        if not self.queue_size or int(self.queue_count) == 0:
            return total_of(self.local_term(image_features=x, text_features=y, target_embeddings=t, **base_in))
        n = int(self.queue_count)
        in_r = nearest(self.queue_key[:n], self.centroids(j).to(self.queue_key)) == r
        qx, qy = self.queue_image[:n][in_r].to(x), self.queue_text[:n][in_r].to(y)
        s = base_in["logit_scale"]
        labels = torch.arange(x.shape[0], device=x.device)
        return 0.5 * (F.cross_entropy(s * x @ torch.cat([y, qy]).T, labels)
                      + F.cross_entropy(s * y @ torch.cat([x, qx]).T, labels))


