"""What every objective declares, so that the trainer needs no edit for a new one.

An objective is an ``nn.Module`` subclassing :class:`Objective`. Its class (or instance) says in one
place, :attr:`Objective.needs` (a set of names from :data:`NEEDS`), what its forward reads beyond the
features, and the training task (:mod:`mmpretrain.train.task`) provides exactly that: a need that is a
batch field (:mod:`mmpretrain.data.batch` declares which field serves which need) reaches the forward
as a keyword of the field's name; the others are provided by the model or the constructor, as
:data:`NEEDS` says. ``encodings`` says where ``image_encodings`` come from. Besides the needs:

- ``whole_batch``: it must see the whole batch in one call, so plain micro-batch accumulation is refused
  (gradient caching is fine);
- ``uses_logit_scale`` / ``uses_logit_bias``: whether its loss depends on the model's scale / bias. The
  trainer freezes the ones no term uses, since DDP stops at the second step on a registered parameter
  that gets no gradient (and an unused parameter would only decay).

Every forward also receives the step context ``step`` (the optimizer step, from 0) and ``epoch`` (the
1-based epoch of the batch being trained on, from the stream), and ignores keywords it does not use.
State (banks, weights, counters) lives in the module's ``state_dict`` (buffers): the trainer saves it
with every checkpoint as safetensors and restores it on resume. ``init_logit_scale`` /
``init_logit_bias`` are the initial values the objective prefers for the model's scale and bias.
State that must move only with accepted steps is proposed in forward and applied in
:meth:`Objective.commit_step`, which the trainer calls once the step's loss is finite on every rank
(:meth:`Objective.discard_step` otherwise).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mmpretrain.data.batch import batch_needs

#: Every need an objective can declare (:attr:`Objective.needs`) and what the trainer then provides: the
#: needs batch fields serve, declared with those fields (:mod:`mmpretrain.data.batch`), and these, which the
#: model or the constructor provides.
NEEDS: dict[str, str] = {
    "targets": "target_embeddings (B, E): the frozen caption embeddings, stored with the shards or computed "
               "online by targets.model",
    "image_encodings": "image_encodings (B, P): the image tower's pooled output before its projection "
                       "(detached), from the model's forward, or with encodings = 'ema' from the train.ema "
                       "average's image tower",
    "caption": "caption_logits (B, L-1, V) and caption_labels (B, L-1): the model's caption decoder (a CoCa arch) "
               "teacher-forced on the batch's caption tokens, from the model's forward (with caption=True)",
    "self_distill": "student_local (B, n, K), the student's global head on each sample's n local crops (cut in the "
                    "loader from the stored sample), from the model's forward, and teacher_global (B, K), the train.ema "
                    "average's on the global view, from the training task (no gradient)",
    "masked_prediction": "student_masked (B, M, K), the student's patch head at the M patches the mask token replaced, "
                         "from the model's forward, and teacher_masked (B, M, K), the train.ema average's there on the "
                         "unmasked view, from the training task (no gradient)",
    "dataset_size": "the constructor is given dataset_size (samples per epoch) unless its options set it",
    "index_size": "the constructor is given index_size, the number of distinct sample indices (the training "
                  "data's samples over every source, from sizes.json), for per-sample tables",
    **batch_needs(),
}


def is_term(key: str) -> bool:
    """Whether an objective's output key is a loss term (weighted ``*_loss``, logged ``*_unweighted``),
    not a diagnostic: the one rule the trainer's zeroing, non-finite report and logs apply."""
    return key.endswith(("_loss", "_unweighted"))


def total_of(out: dict[str, torch.Tensor]) -> torch.Tensor:
    """The objective's value: the sum of its ``*_loss`` outputs (already weighted)."""
    return sum(v for k, v in out.items() if k.endswith("_loss"))


class Objective(nn.Module):
    """Subclasses call ``super().__init__(rank=..., world_size=..., chunk_size=...)``: the options every
    constructor accepts, checked here once. ``tiled``: whether the objective offers ``chunk_size``
    (``chunk x chunk`` tiles recomputed in backward); ``name``: its registry name, for messages."""

    name: str = "objective"
    tiled: bool = False
    init_logit_scale: float = math.log(1 / 0.07)
    init_logit_bias: float | None = None
    needs: frozenset[str] = frozenset()  # names from NEEDS; an instance may set its own
    encodings: str | None = None  # with "image_encodings": "online" (the model's forward) or "ema"
    whole_batch: bool = False
    uses_logit_scale: bool = True
    uses_logit_bias: bool = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        check_needs(cls.needs, cls.name)

    def __init__(self, *, rank: int = 0, world_size: int = 1, chunk_size: int | None = None):
        super().__init__()
        if not (isinstance(world_size, int) and isinstance(rank, int) and 0 <= rank < world_size):
            raise ValueError(f"{self.name}: rank={rank}, world_size={world_size}: need 0 <= rank < world_size")
        if chunk_size is not None and not self.tiled:
            raise ValueError(f"{self.name} is not tiled; leave chunk_size unset (clip, sigmoid, soft_target tile)")
        if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size <= 0):
            raise ValueError(f"{self.name}: chunk_size must be a positive number of rows/columns per tile")
        self.rank, self.world_size, self.chunk_size = rank, world_size, chunk_size

    def largest_matrix(self, batch: int) -> int:
        """Elements of the largest matrix over the batch (logits, targets, their gradients) one step builds
        on a rank holding ``batch`` samples, ``batch * world_size`` once gathered: what a recipe's memory
        check and the run's start line count. The default, the gathered batch squared, is the most any
        objective here builds; tests hold every objective's figure to a trace of its forward and backward."""
        gathered = batch * self.world_size
        return self.tiles(gathered, gathered)

    def tiles(self, rows: int, cols: int) -> int:
        """A ``rows x cols`` matrix's elements, or one ``chunk x chunk`` tile's when tiled."""
        c = self.chunk_size
        return rows * cols if c is None else min(c, rows) * min(c, cols)

    def commit_step(self, accepted: torch.Tensor | None = None) -> None:
        """Apply the state update the last forward proposed: the step was accepted, or ``accepted`` (a 0-dim
        bool tensor) says on the device whether it was (the update must then not read it on the host)."""

    def discard_step(self) -> None:
        """Drop the state update the last forward proposed (the step was skipped)."""


def check_needs(needs, name: str) -> None:
    """Every name in ``needs`` one of :data:`NEEDS`: a misspelt need fails where it is declared (a wrapper's
    needs, a property computed from its terms, are checked where those are)."""
    unknown = sorted(set(class_needs_of(needs)) - NEEDS.keys())
    if unknown:
        raise TypeError(f"{name}: unknown need(s) {unknown}; declare names from losses.base.NEEDS: {sorted(NEEDS)}")


def class_needs(cls) -> frozenset[str]:
    """What a class declares before it is built (a wrapper's needs, known once built, count as none here)."""
    return class_needs_of(getattr(cls, "needs", frozenset()))


def class_needs_of(needs) -> frozenset[str]:
    return frozenset() if isinstance(needs, property) else frozenset(needs)
