"""Global contrastive objective (SogCLR, Yuan et al. ICML 2022; FastCLIP, Wei et al. 2024); docs/methods.md.

Mini-batch InfoNCE estimates each anchor's normaliser from the batch alone. This objective keeps, for
every training sample ``i`` (by its stable global index), running estimates ``u_i^I``, ``u_i^T`` of
its normalisers over the whole dataset. With ``B`` the global batch and ``s`` the scale:

    g_i^I = 1/(B-1) sum_{j != i} exp(s (x_i.y_j - x_i.y_i))
    g_i^T = 1/(B-1) sum_{j != i} exp(s (y_i.x_j - x_i.y_i))
    u_i  <- (1 - gamma) u_i + gamma g_i        (detached; before use; unset or non-finite u_i takes g_i)
    F     = 1/B sum_i (g_i^I / u_i^I + g_i^T / u_i^T)      (u constant: F's gradient is the update's)

With ``gamma = 1`` F's feature gradient is that of ``1/B sum_i (log g_i^I + log g_i^T)``.
``temperature_scheme``: ``global`` (FastCLIP-v3: a learnable global temperature with the surrogate
``F / s_detached + rho / s + mean_i(log u_i^I + log u_i^T) / (2 s)``) or ``fixed`` (``F`` alone, the
scale frozen at ``1 / temperature``, as SogCLR). ``gamma`` follows FastCLIP's schedule per 0-based
epoch ``e``: 1 at ``e = 0`` (no estimate has history yet), then ``gamma`` (``constant``) or the cosine
from 1 down to ``gamma`` over ``gamma_decay_epochs`` (``cosine``).

Numerics: ``exp(s * delta)`` overflows fp32 for ``delta > 0.887`` at ``s = 100``, so the tables hold
``log u`` and everything runs in fp32 in log space (``log g`` by log-sum-exp, ``g / u`` as
``exp(log g - log u)``, at most ``1 / gamma``), whatever the autocast.

State: the two tables (``index_size`` floats each, fp32) are buffers, replicated on every rank: each
rank computes the whole gathered batch's estimates (as ``clip``'s global form computes the whole
loss), so the tables stay identical with no exchange beyond the batch's ``B`` indices. The forward
only *proposes* the batch's new values; the trainer applies them with :meth:`commit_step` once the step
is accepted (a non-finite step is discarded, :meth:`discard_step`), so the estimates move only with
accepted steps. When a resampled batch holds one index twice, the last occurrence's value wins.
"""

from __future__ import annotations

import math

import torch

from mmpretrain.losses.base import Objective
from mmpretrain.losses.distributed import gather_no_grad, gather_with_grad

SCHEMES = ("global", "fixed")
SCHEDULES = ("constant", "cosine")


def gamma_at(epoch0: int, gamma: float, schedule: str, decay_epochs: int) -> float:
    """FastCLIP's ``adjust_gamma`` for the 0-based epoch ``epoch0``."""
    if epoch0 <= 0:
        return 1.0
    if schedule == "constant" or epoch0 >= decay_epochs:
        return gamma
    return 0.5 * (1 + math.cos(math.pi * epoch0 / decay_epochs)) * (1 - gamma) + gamma


def last_occurrence(index: torch.Tensor) -> torch.Tensor:
    """For each position, the position of its index's last occurrence (deterministic, any device, no
    data-dependent shape: nothing waits for the device)."""
    n = index.numel()
    pos = torch.arange(n, device=index.device)
    order = torch.sort(index, stable=True).indices  # equal indices in position order
    ranked = index[order]
    ends = torch.ones(n, dtype=torch.bool, device=index.device)
    ends[:-1] = ranked[:-1] != ranked[1:]  # the last of each run of equal indices
    # each sorted position's run end: the nearest end at or after it (a cumulative min from the right)
    end = torch.where(ends, pos, n).flip(0).cummin(0).values.flip(0)
    return torch.empty_like(order).scatter_(0, order, order[end])


class GlobalClipLoss(Objective):
    """``global_clip``: the dataset-level contrastive objective with per-sample normaliser estimates.

    Options: ``gamma`` (final γ, in (0, 1]), ``gamma_schedule`` (``constant`` | ``cosine``),
    ``gamma_decay_epochs`` (for ``cosine``), ``temperature_scheme`` (``global`` | ``fixed``), ``rho``
    (FastCLIP-v3's ρ), ``temperature`` (the initial τ = 1/s; the fixed one with ``fixed``);
    ``index_size`` (the table length: the dataset's sample count, given by the trainer)."""

    name = "global_clip"

    needs = frozenset({"sample_index", "index_size"})
    whole_batch = True  # the estimates are per whole-batch row: micro-batch accumulation is refused

    def __init__(self, *, index_size: int | None = None, gamma: float = 0.8, gamma_schedule: str = "cosine",
                 gamma_decay_epochs: int = 10, temperature_scheme: str = "global", rho: float = 8.0,
                 temperature: float = 0.07, rank: int = 0, world_size: int = 1, chunk_size: int | None = None):
        super().__init__(rank=rank, world_size=world_size, chunk_size=chunk_size)
        if index_size is None or int(index_size) < 2:
            raise ValueError("global_clip: index_size (the dataset's sample count) must be at least 2; the "
                             "trainer sets it from the training data's sizes.json")
        if not 0 < gamma <= 1:
            raise ValueError(f"global_clip: gamma={gamma} must be in (0, 1]")
        if gamma_schedule not in SCHEDULES:
            raise ValueError(f"global_clip: gamma_schedule={gamma_schedule!r}: choose one of {list(SCHEDULES)}")
        if gamma_schedule == "cosine" and gamma_decay_epochs < 1:
            raise ValueError("global_clip: gamma_schedule=cosine needs gamma_decay_epochs >= 1")
        if temperature_scheme not in SCHEMES:
            raise ValueError(f"global_clip: temperature_scheme={temperature_scheme!r}: choose one of {list(SCHEMES)} "
                             "(per-sample temperatures are not offered, see docs/methods.md)")
        if not temperature > 0:
            raise ValueError(f"global_clip: temperature={temperature} must be positive")
        self.gamma, self.gamma_schedule, self.gamma_decay_epochs = float(gamma), gamma_schedule, int(gamma_decay_epochs)
        self.scheme, self.rho = temperature_scheme, float(rho)
        self.init_logit_scale = math.log(1 / temperature)
        self.uses_logit_scale = temperature_scheme == "global"
        # log u per sample; NaN = never seen
        self.register_buffer("log_u_image", torch.full((int(index_size),), float("nan")))
        self.register_buffer("log_u_text", torch.full((int(index_size),), float("nan")))
        self._pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def forward(self, *, image_features: torch.Tensor, text_features: torch.Tensor, logit_scale,
                sample_index: torch.Tensor | None = None, epoch: int = 1, **extra) -> dict[str, torch.Tensor]:
        if sample_index is None:
            raise ValueError("global_clip needs sample_index (the batch's global sample indices)")
        with torch.autocast(image_features.device.type, enabled=False):
            return self._forward(image_features, text_features, logit_scale, sample_index, epoch)

    def _forward(self, x, y, logit_scale, sample_index, epoch):
        dtype = torch.promote_types(x.dtype, torch.float32)  # fp32 at least (float64 stays, for the tests)
        x = gather_with_grad(x, self.world_size).to(dtype)
        y = gather_with_grad(y, self.world_size).to(dtype)
        index = gather_no_grad(sample_index.to(x.device).long(), self.world_size)
        # checked without a host read (on a GPU, a device-side assert; on a CPU it raises here)
        torch._assert_async(((index >= 0) & (index < self.log_u_image.numel())).all(),
                            f"global_clip: sample_index outside [0, {self.log_u_image.numel()}): the table was "
                            "sized for another dataset")
        n = x.shape[0]
        if n < 2:
            raise ValueError("global_clip needs a global batch of at least 2")
        s = torch.as_tensor(logit_scale, device=x.device).to(dtype)
        sim = x @ y.T
        diag = sim.diagonal().unsqueeze(1)
        off = ~torch.eye(n, dtype=torch.bool, device=x.device)
        minus_inf = torch.tensor(float("-inf"), device=x.device)
        log_norm = math.log(n - 1)
        log_g_i = torch.logsumexp(torch.where(off, s * (sim - diag), minus_inf), dim=1) - log_norm
        log_g_t = torch.logsumexp(torch.where(off, s * (sim.T - diag), minus_inf), dim=1) - log_norm
        gamma = gamma_at(int(epoch) - 1, self.gamma, self.gamma_schedule, self.gamma_decay_epochs)
        table_i, table_t = self.log_u_image.to(x), self.log_u_text.to(x)
        new_i = self._update(table_i[index], log_g_i.detach(), gamma)
        new_t = self._update(table_t[index], log_g_t.detach(), gamma)
        f = (torch.exp(log_g_i - new_i) + torch.exp(log_g_t - new_t)).mean()
        self._pending = (index, new_i, new_t)
        if self.scheme == "global":
            loss = f / s.detach() + self.rho / s + (new_i + new_t).mean() / (2 * s)
        else:
            loss = f
        return {"global_clip_loss": loss, "global_clip/log_u": 0.5 * (new_i + new_t).mean(),
                "global_clip/gamma": torch.tensor(gamma)}

    @staticmethod
    def _update(old: torch.Tensor, log_g: torch.Tensor, gamma: float) -> torch.Tensor:
        """``log((1 - γ) u + γ g)``; an unset or non-finite ``u`` takes ``g``."""
        if gamma >= 1:
            return log_g
        mixed = torch.logaddexp(old + math.log(1 - gamma), log_g + math.log(gamma))
        return torch.where(torch.isfinite(old), mixed, log_g)

    def commit_step(self, accepted: torch.Tensor | None = None) -> None:
        """Write the accepted step's estimates into the tables (the last occurrence of an index wins: every
        occurrence writes its value). ``accepted``: a 0-dim bool tensor; False writes the old values back."""
        if self._pending is None:
            return
        index, new_i, new_t = self._pending
        self._pending = None
        last = last_occurrence(index)
        idx = index.to(self.log_u_image.device)
        for table, new in ((self.log_u_image, new_i), (self.log_u_text, new_t)):
            value = new[last].to(table)
            if accepted is not None:
                value = torch.where(accepted.to(table.device), value, table[idx])
            table.index_copy_(0, idx, value)

    def discard_step(self) -> None:
        self._pending = None
