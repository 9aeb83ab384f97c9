"""Objectives: one file each, one forward signature, dict output ``{"<name>_loss": tensor}``.

``LOSSES[name](**options)`` -> an :class:`~mmpretrain.losses.base.Objective` (``nn.Module``); every
constructor also accepts ``rank``, ``world_size`` and ``chunk_size``. Forward keywords:
``image_features (B, D)``, ``text_features (B, D)``, ``logit_scale`` (exponentiated), ``logit_bias``,
``target_embeddings (B, E)``, ``teacher_image_embeddings`` / ``teacher_text_embeddings (B, E)`` and
``teacher_dims``, the step context (``step``, ``epoch``) and what the objective declares
it needs (``labels``, ``sample_index``); unknown keywords are ignored. See ``base.py`` for the
declarations and ARCHITECTURE.md for adding one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from mmpretrain.losses.align_uniform import AlignUniformLoss
from mmpretrain.losses.base import NEEDS, Objective, class_needs, is_term, total_of
from mmpretrain.losses.caption import CaptionLoss
from mmpretrain.losses.clip import ClipLoss
from mmpretrain.losses.cwcl import CwclLoss
from mmpretrain.losses.distill import DistillLoss
from mmpretrain.losses.global_clip import GlobalClipLoss
from mmpretrain.losses.regions import RegionLoss
from mmpretrain.losses.registry import OBJECTIVES
from mmpretrain.losses.resa import ResaLoss
from mmpretrain.losses.self_supervised import HeadSpec, LocalCrops, MaskedPredictionLoss, SelfDistillLoss
from mmpretrain.losses.sigmoid import SigmoidLoss
from mmpretrain.losses.soft_target import SoftTargetLoss
from mmpretrain.losses.vrn import VrnLoss

# every objective by its config name: the registry's, the wrapper around any one of them, resa (its
# targets are of the whole batch's encodings, which a region's sub-batch does not carry: not wrappable) and
# caption (per-token, of the decoder's logits: nothing of a region's features), and SigLIP 2's self-supervised
# terms (per sample, of the teacher's views: none of a region's)
LOSSES: dict[str, type[Objective]] = {**OBJECTIVES, "regions": RegionLoss, "resa": ResaLoss, "caption": CaptionLoss,
                                      "self_distill": SelfDistillLoss, "masked_prediction": MaskedPredictionLoss}


def _any_term(flag: str, default: bool = False) -> property:
    """Whether any term declares ``flag`` (``default`` for a term that says nothing)."""
    return property(lambda self: any(getattr(t, flag, default) for t in self.terms),
                    doc=f"whether any term declares {flag}")


class WeightedObjective(nn.Module):
    """A weighted sum of named terms. Returns each term's ``*_loss`` already weighted (so the
    trainer's sum of ``*_loss`` keys is the objective) plus ``<key>_unweighted`` for logging. It needs
    what any of its terms needs; its ``state_dict`` holds every term's state."""

    def __init__(self, terms: Sequence[tuple[str, float, nn.Module]]):
        super().__init__()
        self.names = [n for n, _, _ in terms]
        self.weights = [float(w) for _, w, _ in terms]
        self.terms = nn.ModuleList([m for _, _, m in terms])

    @property
    def needs(self) -> frozenset[str]:
        """What any of its terms needs (:data:`~mmpretrain.losses.base.NEEDS`)."""
        return frozenset().union(*(t.needs for t in self.terms))

    @property
    def encodings(self) -> str | None:
        """Where the terms that need image encodings take them: ``online`` (the model's forward) or
        ``ema`` (the weight average's image tower, computed by the trainer); None when none does."""
        found = {t.encodings for t in self.terms if "image_encodings" in t.needs}
        if len(found) > 1:
            raise ValueError("loss terms take image encodings from both the online weights and the ema")
        return next(iter(found), None)

    def for_decoder(self, context_length: int, vocab_size: int) -> WeightedObjective:
        """Every caption term's matrix for a decoder over ``context_length`` tokens and ``vocab_size`` ids
        (:meth:`~mmpretrain.losses.caption.CaptionLoss.for_decoder`; the trainer's, from the model)."""
        for t in self.terms:
            if hasattr(t, "for_decoder"):
                t.for_decoder(context_length, vocab_size)
        return self

    @property
    def ssl_heads(self) -> list[HeadSpec]:
        """The DINO heads the self-supervised terms train (:mod:`mmpretrain.models.ssl`)."""
        return [t.head for t in self.terms if isinstance(getattr(t, "head", None), HeadSpec)]

    @property
    def local_crops(self) -> LocalCrops | None:
        """The local crops the loader cuts per sample (``self_distill``), or None."""
        return next((t.local for t in self.terms if isinstance(getattr(t, "local", None), LocalCrops)), None)

    def ssl_active(self, step: int) -> frozenset[str]:
        """The self-supervised needs whose terms run at ``step`` (past their start)."""
        return frozenset(n for t in self.terms if hasattr(t, "active") and t.active(step) for n in t.needs)

    def for_schedule(self, total_steps: int) -> WeightedObjective:
        """Every term's start step in a run of ``total_steps`` (``start_at`` as a share)."""
        for t in self.terms:
            if hasattr(t, "for_schedule"):
                t.for_schedule(total_steps)
        return self

    def for_tower(self, num_patches: int) -> WeightedObjective:
        """The image tower's patch count, for the terms that mask patches."""
        for t in self.terms:
            if hasattr(t, "for_tower"):
                t.for_tower(num_patches)
        return self

    whole_batch = _any_term("whole_batch")
    uses_logit_scale = _any_term("uses_logit_scale", default=True)
    uses_logit_bias = _any_term("uses_logit_bias")

    @property
    def init_logit_scale(self) -> float:
        return self.terms[0].init_logit_scale

    @property
    def init_logit_bias(self) -> float | None:
        """The first declared bias: a sigmoid term anywhere in the sum gets the bias it needs."""
        return next((t.init_logit_bias for t in self.terms if t.init_logit_bias is not None), None)

    def largest_matrix(self, batch: int) -> int:
        """The largest of its terms' (:meth:`Objective.largest_matrix`)."""
        return max(getattr(t, "largest_matrix", lambda b: 0)(batch) for t in self.terms)

    def commit_step(self, accepted: torch.Tensor | None = None) -> None:
        for term in self.terms:
            if hasattr(term, "commit_step"):
                term.commit_step(accepted)

    def discard_step(self) -> None:
        for term in self.terms:
            getattr(term, "discard_step", lambda: None)()

    def forward(self, **inputs) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for weight, term in zip(self.weights, self.terms):
            for key, value in term(**inputs).items():
                if key.endswith("_loss"):  # base.total_of sums these
                    out[key] = weight * value
                    out[key[: -len("_loss")] + "_unweighted"] = value.detach()
                else:
                    out[key] = value
        return out


def build_objective(terms: Sequence[dict], rank: int = 0, world_size: int = 1,
                    dataset_size: int | None = None, index_size: int | None = None) -> WeightedObjective:
    """``terms``: ``[{"name": "clip", "weight": 1.0, "options": {...}}, ...]`` (the config's ``loss``).
    ``dataset_size`` / ``index_size`` reach the objectives that need them (``needs``) unless their options
    set them."""
    built = []
    seen = set()
    for i, t in enumerate(terms):
        name = t["name"]
        if name not in LOSSES:
            raise ValueError(f"unknown objective {name!r}; choose one of {sorted(LOSSES)}")
        if name in seen:
            raise ValueError(f"objective {name!r} listed twice; give it one weight")
        seen.add(name)
        cls = LOSSES[name]
        options = dict(t.get("options", {}))
        if "dataset_size" in class_needs(cls) and dataset_size is not None:
            options.setdefault("dataset_size", dataset_size)
        if "index_size" in class_needs(cls) and index_size is not None:
            if options.setdefault("index_size", index_size) < index_size:
                raise ValueError(f"loss {name}: options.index_size={options['index_size']} is smaller than the "
                                 f"training data's {index_size} samples; leave it unset (the trainer sets it)")
        try:  # the term's place in the config's loss list, with what its constructor refused
            built.append((name, t.get("weight", 1.0), cls(rank=rank, world_size=world_size, **options)))
        except TypeError as e:  # an option the constructor does not take
            raise ValueError(f"loss.{i}: bad options for objective {name!r}: {e}") from None
        except ValueError as e:
            raise ValueError(f"loss.{i}: {e}") from None
    return WeightedObjective(built)


def validate_objective(terms: Sequence[dict]) -> WeightedObjective:
    """:func:`build_objective` on one process before the data is known (the config's check when it
    loads): an objective that needs ``index_size`` gets a stand-in table length unless its
    options set one; setup builds the real one with the data's sizes."""
    stand_in = [dict(t, options={"index_size": 2, **t.get("options", {})})
                if "index_size" in class_needs(LOSSES.get(t["name"])) else t for t in terms]
    return build_objective(stand_in)


__all__ = ["LOSSES", "NEEDS", "AlignUniformLoss", "ClipLoss", "CwclLoss", "DistillLoss", "GlobalClipLoss", "MaskedPredictionLoss", "Objective",
           "RegionLoss", "ResaLoss", "SelfDistillLoss", "SigmoidLoss",
           "SoftTargetLoss", "VrnLoss", "WeightedObjective", "build_objective", "is_term", "total_of",
           "validate_objective"]
