"""Frozen image features for the probe tasks: projected (normalised) and pre-projection, rank-split and
gathered, for a test split and, where the task trains a probe, a train split."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mmpretrain.eval.context import EvalContext, batches, cat_or_empty, gather_in_order
from mmpretrain.eval.datasets import EvalDataset, check_labels


@torch.no_grad()
def image_features(model, preprocess, ds: EvalDataset, ctx: EvalContext):
    """``(feats (N, D), preproj (N, P) or None, labels (N,))`` over the dataset's labelled samples, in
    dataset order, on every rank.

    Pre-projection features are the image tower's pooled output before its projection, available
    for open_clip ViT towers (``visual.proj``); other towers return None. With ``ctx.features`` (a dict
    for one model's run) a dataset's pass is made once and reused by later tasks, its skipped samples
    counted again for each."""
    key = dataset_key(ds)
    if ctx.features is not None and key in ctx.features:
        out, skipped = ctx.features[key]
        ctx.skipped.update(skipped)
        return out
    before = Counter(ctx.skipped)
    out = _image_features(model, preprocess, ds, ctx)
    if ctx.features is not None:
        ctx.features[key] = (out, Counter(ctx.skipped) - before)
    return out


def dataset_key(ds: EvalDataset) -> tuple:
    """What makes two loaded datasets the same samples: their files (or Hub dataset) and layout."""
    files = tuple(str(p) for p, _ in ds.files) if ds.files else ()
    return (ds.name, ds.layout, tuple(str(p) for p in ds.shards), files, getattr(ds.hf[0], "_fingerprint", id(ds.hf[0])) if ds.hf else None)


def _image_features(model, preprocess, ds: EvalDataset, ctx: EvalContext):
    visual = model.visual
    has_proj = isinstance(getattr(visual, "proj", None), torch.Tensor)
    index, feats, pre, labels = [], [], [], []
    for idx, images, _, labs in batches(ds, preprocess, ctx, labelled_only=True, desc=f"{ds.name} features"):
        x = images.to(ctx.device)
        feats.append(model.encode_image(x, normalize=True).float().cpu())
        if has_proj:
            proj = visual.proj
            try:
                visual.proj = None
                pooled = visual(x)
                if isinstance(pooled, tuple):  # a tower that also returns its tokens (CoCa's: the decoder's input)
                    pooled = pooled[0]
                pre.append(F.normalize(pooled.float(), dim=-1).cpu())
            finally:
                visual.proj = proj
        index.append(idx)
        labels += labs
    local = {"feats": cat_or_empty(feats), "pre": cat_or_empty(pre), "labels": torch.tensor(labels, dtype=torch.long)}
    out, _ = gather_in_order(local, cat_or_empty(index, torch.long), ctx.world_size)
    if out["labels"] is None:
        raise ValueError(f"{ds.name}: no labelled samples")
    return out["feats"], out["pre"], out["labels"]


def num_classes(ds: EvalDataset, *labels: torch.Tensor) -> int:
    """The dataset's class names, checked against the labels; else the largest label + 1."""
    if not ds.classnames:
        return int(max(int(y.max()) for y in labels)) + 1
    for y in labels:
        check_labels(ds, y, len(ds.classnames))
    return len(ds.classnames)


@dataclass
class ProbeFeatures:
    """Train and test features of a probe: ``pairs`` = ``[(metric suffix, train (N, D), test (M, D))]``,
    ``""`` for projected features, ``"_preproj"`` for pre-projection ones where the tower has them."""

    pairs: list[tuple[str, torch.Tensor, torch.Tensor]]
    train_labels: torch.Tensor
    test_labels: torch.Tensor
    classes: int


def probe_features(model, preprocess, splits: tuple[EvalDataset, EvalDataset], ctx: EvalContext) -> ProbeFeatures:
    train, test = splits
    te_x, te_pre, te_y = image_features(model, preprocess, test, ctx)
    tr_x, tr_pre, tr_y = image_features(model, preprocess, train, ctx)
    pairs = [("", tr_x, te_x)] + ([("_preproj", tr_pre, te_pre)] if te_pre is not None else [])
    return ProbeFeatures(pairs, tr_y, te_y, num_classes(test, te_y, tr_y))


def suffixed_chance(base: dict[str, float], pairs: list[tuple[str, torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    """The chance levels of ``base``'s metrics for every feature kind of ``pairs``."""
    return {k + suffix: v for suffix, _, _ in pairs for k, v in base.items()}
