"""SigLIP 2's self-supervised half, against the ``train.ema`` weight average as teacher: ``self_distill``
(SILC's local-to-global consistency, Naeem et al., 2023) and ``masked_prediction`` (TIPS's masked patch
prediction, Maninis et al., 2024), both with DINO's loss (Caron et al., 2021; iBOT's for the patches):

    p_t = softmax((t - c) / tau_t),    L = -1/R sum_r sum_k p_t[r, k] log softmax(s_r / tau_s)[k]

``self_distill``: a row ``r`` per local crop: ``s (B, n, K)`` the student's head (``DualEncoder.ssl``'s
``global`` head on the image tower's pooled output before its projection) on each sample's ``n`` local
crops, drawn in the loader from the stored sample; ``t (B, K)`` the teacher's head on the sample's global
view (the crop the contrastive term trains on), the same target for its ``n`` crops. ``masked_prediction``:
a row per masked patch: ``s (B, M, K)`` the student's ``patch`` head on its output tokens at the ``M``
positions whose patch embeddings the mask token replaced, ``t (B, M, K)`` the teacher's on the unmasked view
at those positions. ``R`` counts the rows. ``c (K,)``, the centre, is a buffer (saved with every
checkpoint): after each accepted step ``c <- m c + (1 - m) mean(t)`` over the global batch's teacher outputs
(an all-reduce), as DINO's ``update_center``; the step uses the centre from before it.

``start_at``: the step the term starts at, as a share of the run's steps (a float in [0, 1), SigLIP 2's
0.8) or a step number (an int); before it the term is 0, the extra forwards do not run and the centre does
not move. The teacher is the average as ``train.ema`` keeps it; ``train.ema.warmup_steps`` set to the start
step makes it a copy of the weights up to there, SigLIP 2's teacher initialised from the student.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mmpretrain.losses.base import Objective


@dataclass(frozen=True)
class HeadSpec:
    """A DINO head of the model (``DualEncoder.ssl``): ``name`` (``global`` or ``patch``), ``out_dim``
    prototypes, an MLP of ``hidden_dim`` to an L2-normalised ``bottleneck_dim``."""

    name: str
    out_dim: int
    hidden_dim: int
    bottleneck_dim: int


@dataclass(frozen=True)
class LocalCrops:
    """``count`` crops per sample at ``size`` pixels, each a random resized crop of the stored image with an
    area share in ``scale`` (DINO's local crops: 96 px, 0.05 to 0.4)."""

    count: int
    size: int
    scale: tuple[float, float]


def _positive_int(value, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{what} must be a whole number >= 1, not {value!r}")
    return value


class SelfSupervisedTerm(Objective):
    """The common part: the head, the temperatures, the centre and the start step."""

    head_name = ""
    student_key = teacher_key = ""
    uses_logit_scale = False

    def __init__(self, *, out_dim: int = 1024, hidden_dim: int = 2048, bottleneck_dim: int = 256,
                 student_temp: float = 0.1, teacher_temp: float = 0.04, centre_momentum: float = 0.9,
                 start_at: float | int = 0.8, rank: int = 0, world_size: int = 1, chunk_size: int | None = None):
        super().__init__(rank=rank, world_size=world_size, chunk_size=chunk_size)
        for value, what in ((student_temp, "student_temp"), (teacher_temp, "teacher_temp")):
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"{self.name}: {what} must be > 0, not {value!r}")
        if not (isinstance(centre_momentum, (int, float)) and 0 <= centre_momentum < 1):
            raise ValueError(f"{self.name}: centre_momentum must be in [0, 1), not {centre_momentum!r}")
        if isinstance(start_at, bool) or not isinstance(start_at, (int, float)) or start_at < 0 or (
                isinstance(start_at, float) and start_at >= 1):
            raise ValueError(f"{self.name}: start_at must be a share of the run's steps in [0, 1) (0.8: at 80 %) or "
                             f"a step number (an int), not {start_at!r}")
        self.head = HeadSpec(self.head_name, _positive_int(out_dim, f"{self.name}: out_dim"),
                             _positive_int(hidden_dim, f"{self.name}: hidden_dim"),
                             _positive_int(bottleneck_dim, f"{self.name}: bottleneck_dim"))
        self.student_temp, self.teacher_temp = float(student_temp), float(teacher_temp)
        self.centre_momentum, self.start_at = float(centre_momentum), start_at
        self.start_step = start_at if isinstance(start_at, int) else 0  # a share: set by for_schedule
        self.register_buffer("centre", torch.zeros(out_dim))
        # the proposal: the teacher rows' sum and count since the last step (micro-batches add up), on the device
        self._sum: torch.Tensor | None = None
        self._rows: torch.Tensor | None = None

    def for_schedule(self, total_steps: int) -> SelfSupervisedTerm:
        """The start step of a run of ``total_steps`` optimizer steps (``start_at`` as a share)."""
        if isinstance(self.start_at, float):
            self.start_step = math.floor(self.start_at * total_steps)
        if self.start_step >= total_steps:
            raise ValueError(f"loss {self.name}: options.start_at={self.start_at} starts it at step {self.start_step}, "
                             f"past the run's {total_steps} steps, so it would never run: give a share below 1 (0.8) "
                             "or an earlier step")
        return self

    def active(self, step: int) -> bool:
        return step >= self.start_step

    def largest_matrix(self, batch: int) -> int:
        return batch * self.rows_per_sample() * self.head.out_dim  # this rank's rows x prototypes, never gathered

    def rows_per_sample(self) -> int:
        raise NotImplementedError

    def loss(self, student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        """``student (R, K)`` against ``teacher (R, K)`` rows (already repeated to the student's), in at
        least fp32."""
        dtype = torch.promote_types(student.dtype, torch.float32)
        t = teacher.detach().to(dtype)
        p = F.softmax((t - self.centre.to(dtype)) / self.teacher_temp, dim=-1)
        return -(p * F.log_softmax(student.to(dtype) / self.student_temp, dim=-1)).sum(-1).mean()

    @torch.no_grad()
    def propose(self, teacher: torch.Tensor) -> None:
        """Adds the teacher rows ``(R, K)`` (every rank's, reduced) to the centre's proposal."""
        t = teacher.detach().to(torch.promote_types(teacher.dtype, torch.float32)).reshape(-1, teacher.shape[-1])
        total = t.sum(0)
        rows = t.new_full((1,), float(t.shape[0]))
        if self.world_size > 1:
            dist.all_reduce(total)
            dist.all_reduce(rows)
        self._sum = total if self._sum is None else self._sum + total
        self._rows = rows if self._rows is None else self._rows + rows

    @torch.no_grad()
    def commit_step(self, accepted: torch.Tensor | None = None) -> None:
        if self._sum is None:
            return
        mean = self._sum / self._rows
        new = self.centre * self.centre_momentum + mean.to(self.centre.dtype) * (1 - self.centre_momentum)
        self.centre.copy_(new if accepted is None else torch.where(accepted.to(new.device), new, self.centre))
        self.discard_step()

    def discard_step(self) -> None:
        self._sum = self._rows = None

    def forward(self, *, step: int = 0, **inputs) -> dict[str, torch.Tensor]:
        student, teacher = inputs.get(self.student_key), inputs.get(self.teacher_key)
        key = f"{self.name}_loss"
        if student is None or teacher is None:
            if self.active(step):
                raise ValueError(f"{self.name} at step {step} (from {self.start_step}) needs {self.student_key} and "
                                 f"{self.teacher_key}, which this forward was not given")
            return {key: self.centre.new_zeros(())}
        self.propose(teacher)  # the teacher's own rows (a global view's once, not once per local crop: the same mean)
        if teacher.dim() == student.dim() - 1:  # one global target for each of a sample's local crops
            teacher = teacher.unsqueeze(1).expand_as(student)
        return {key: self.loss(student.flatten(0, -2), teacher.flatten(0, -2))}


class SelfDistillLoss(SelfSupervisedTerm):
    """``self_distill``: ``local_crops`` per sample at ``local_size`` pixels with an area share in
    ``local_scale``, and the head and loss options of :class:`SelfSupervisedTerm`."""

    name = "self_distill"
    needs = frozenset({"self_distill"})
    head_name = "global"
    student_key, teacher_key = "student_local", "teacher_global"

    def __init__(self, *, local_crops: int = 4, local_size: int = 96, local_scale: tuple[float, float] = (0.05, 0.4),
                 **options):
        super().__init__(**options)
        scale = tuple(local_scale) if isinstance(local_scale, (list, tuple)) else ()
        if len(scale) != 2 or not all(isinstance(v, (int, float)) for v in scale) or not 0 < scale[0] <= scale[1] <= 1:
            raise ValueError(f"self_distill: local_scale must be [low, high] area shares with 0 < low <= high <= 1, "
                             f"not {local_scale!r}")
        self.local = LocalCrops(_positive_int(local_crops, "self_distill: local_crops"),
                                _positive_int(local_size, "self_distill: local_size"), (float(scale[0]), float(scale[1])))

    def rows_per_sample(self) -> int:
        return self.local.count


class MaskedPredictionLoss(SelfSupervisedTerm):
    """``masked_prediction``: ``mask_ratio`` of each sample's patches masked (drawn per sample and step from
    the run's seed), and the head and loss options of :class:`SelfSupervisedTerm`."""

    name = "masked_prediction"
    needs = frozenset({"masked_prediction"})
    head_name = "patch"
    student_key, teacher_key = "student_masked", "teacher_masked"

    def __init__(self, *, mask_ratio: float = 0.5, **options):
        super().__init__(**options)
        if not (isinstance(mask_ratio, (int, float)) and not isinstance(mask_ratio, bool) and 0 < mask_ratio < 1):
            raise ValueError(f"masked_prediction: mask_ratio must be a share of the patches in (0, 1), not {mask_ratio!r}")
        self.mask_ratio = float(mask_ratio)
        self.num_patches = 1  # the tower's, set by the trainer (for_tower)

    def for_tower(self, num_patches: int) -> MaskedPredictionLoss:
        self.num_patches = num_patches
        return self

    def masked_count(self) -> int:
        """How many of the tower's patches each sample masks (at least one, at most all but one)."""
        return min(max(1, int(self.num_patches * self.mask_ratio)), max(1, self.num_patches - 1))

    def rows_per_sample(self) -> int:
        return self.masked_count()
