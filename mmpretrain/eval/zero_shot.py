"""Task ``zeroshot_classification`` (Radford et al. 2021): per class, encode every template with the
class name, normalise, average, renormalise -> ``(D, C)`` classifier; score ``img @ W``. Metrics as
clip_benchmark names them: ``acc1``, ``acc5``, ``mean_per_class_recall``."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from mmpretrain.eval.context import EvalContext, batches, cat_or_empty, gather_in_order, split_map
from mmpretrain.eval.datasets import EvalDataset, check_labels

DEFAULT_TEMPLATES = ("a photo of a {c}.", "a {c}.", "an image of a {c}.")


def named_templates(spec: str) -> list[str]:
    """``openai_imagenet`` (CLIP's 80 ImageNet prompts), ``simple_imagenet`` (open_clip's short set, as
    open_clip ships them), ``default``, or a file with one ``{c}`` template per line."""
    # open_clip takes ~5 s to import; the evaluation package itself stays importable without it
    from open_clip import zero_shot_metadata

    if spec == "openai_imagenet":
        return [t("{c}") for t in zero_shot_metadata.OPENAI_IMAGENET_TEMPLATES]
    if spec == "simple_imagenet":
        return [t("{c}") for t in zero_shot_metadata.SIMPLE_IMAGENET_TEMPLATES]
    if spec == "default":
        return list(DEFAULT_TEMPLATES)
    p = Path(spec)
    if not p.is_file():
        raise FileNotFoundError(f"--templates {spec}: not openai_imagenet, simple_imagenet, default or a file")
    lines = [line.strip() for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines or any("{c}" not in t for t in lines):
        raise ValueError(f"--templates {spec}: every line needs a {{c}} placeholder")
    return lines


@torch.no_grad()
def build_classifier(model, tokenizer, classnames: list[str], templates: list[str], device) -> torch.Tensor:
    """``(D, C)``: the mean normalised text embedding of each class over the templates, renormalised."""
    columns = []
    for c in classnames:
        texts = [t.replace("{c}", c) for t in templates]
        emb = model.encode_text(tokenizer(texts).to(device), normalize=True)
        columns.append(F.normalize(emb.mean(0), dim=-1))
    return torch.stack(columns, dim=1)


def classification_metrics(logits: torch.Tensor, labels: torch.Tensor, num_classes: int) -> dict[str, float]:
    """``logits (N, C)``, ``labels (N,)``."""
    k = min(5, num_classes)
    topk = logits.topk(k, dim=1).indices
    hit1 = topk[:, 0] == labels
    hitk = (topk == labels[:, None]).any(1)
    n = len(labels)
    # exact ratios of counts (as clip_benchmark and scikit-learn report them), not float32 means
    recalls = [int(hit1[labels == c].sum()) / int((labels == c).sum()) for c in range(num_classes)
               if (labels == c).any()]
    out = {"acc1": int(hit1.sum()) / n, "acc5": int(hitk.sum()) / n,
           "mean_per_class_recall": sum(recalls) / len(recalls)}
    if num_classes < 5:  # top-5 of fewer than 5 classes is always right; clip_benchmark reports no acc5 either
        del out["acc5"]
    return out


def classification_chance(num_classes: int) -> dict[str, float]:
    """What a uniformly random ranking of the classes scores in expectation."""
    out = {"acc1": 1 / num_classes, "acc5": min(5, num_classes) / num_classes, "mean_per_class_recall": 1 / num_classes}
    if num_classes < 5:
        del out["acc5"]
    return out


@torch.no_grad()
def run(model, preprocess, tokenizer, ds: EvalDataset, ctx: EvalContext) -> dict:
    if not ds.classnames:
        raise ValueError(f"{ds.name}: no class names for zero-shot classification: add classnames.txt beside "
                         "test/ (one name per line, in label order) or build the data with class labels")
    templates = ds.templates or list(DEFAULT_TEMPLATES)
    # class embeddings split across ranks, gathered in class order: (C, D) -> (D, C)
    w = split_map(lambda names: build_classifier(model, tokenizer, names, templates, ctx.device).T, ds.classnames,
                  ctx)
    w = w.T.to(ctx.device)
    index, logits, labels = [], [], []
    for idx, images, _, labs in batches(ds, preprocess, ctx, labelled_only=True, desc=f"{ds.name} zero-shot"):
        feats = model.encode_image(images.to(ctx.device), normalize=True)
        logits.append((feats @ w.to(feats.dtype)).float().cpu())
        labels += labs
        index.append(idx)
    local = {"logits": cat_or_empty(logits), "labels": torch.tensor(labels, dtype=torch.long)}
    out, _ = gather_in_order(local, cat_or_empty(index, torch.long), ctx.world_size)
    if out["labels"] is None:
        raise ValueError(f"{ds.name}: no labelled samples for zero-shot classification")
    c = len(ds.classnames)
    check_labels(ds, out["labels"], c)
    return {"n": len(out["labels"]), "metrics": classification_metrics(out["logits"], out["labels"], c),
            "chance": classification_chance(c)}

