"""What the config checks against the rest of the package and outside it -- the objectives' registry
and constructors, the evaluation tasks, open_clip's augmentation keys, the Hub's repository-ID rule --
imported here only, on first use, so that the config package imports nothing of mmpretrain at module
level (the data layer imports :mod:`mmpretrain.config.base` for its remote options)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def check_objective(terms: Sequence[dict[str, Any]]):
    """The config's ``loss`` built once, on one process, with stand-ins for the sizes the training data
    gives at setup: every name known, none twice, every option accepted (``ValueError`` naming the
    term). The one check of an objective's name and options is :func:`mmpretrain.losses.build_objective`'s."""
    from mmpretrain.losses import validate_objective

    return validate_objective(terms)


def whole_batch_terms(names: Sequence[str]) -> list[str]:
    """The terms whose objective declares ``whole_batch`` (a class declaration: nothing is built)."""
    from mmpretrain.losses import LOSSES

    return [n for n in names if getattr(LOSSES.get(n), "whole_batch", False)]


def check_tasks(tasks: Sequence[str]) -> None:
    from mmpretrain.eval import TASKS

    bad = [t for t in tasks if t not in TASKS]
    if bad:
        raise ValueError(f"eval.tasks: {bad[0]!r} is not one of {', '.join(TASKS)}")


def augmentation_keys() -> list[str]:
    """open_clip's ``--aug-cfg`` keys (its AugmentationCfg's fields)."""
    import dataclasses

    from open_clip.transform import AugmentationCfg

    return [f.name for f in dataclasses.fields(AugmentationCfg)]


def check_repo_id(repo_id: str) -> None:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise ValueError(f"not a Hub repository ID (ORG/NAME): {e}") from None
