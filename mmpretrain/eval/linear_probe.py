"""Task ``linear_probe`` on frozen features: multinomial logistic regression (scikit-learn), the inverse
regularisation C chosen on a stratified 20% validation split of the training set, then refit on the
whole training set. Metrics ``lp_acc1``, ``lp_acc5``, ``lp_mean_per_class_recall``."""

from __future__ import annotations

import numpy as np
import torch

from mmpretrain.eval.context import EvalContext
from mmpretrain.eval.datasets import EvalDataset
from mmpretrain.eval.features import probe_features, suffixed_chance
from mmpretrain.eval.zero_shot import classification_chance, classification_metrics

C_GRID = (0.01, 0.1, 1.0, 10.0, 100.0)


def _fit(x, y, c, seed):
    from sklearn.linear_model import LogisticRegression

    return LogisticRegression(C=c, max_iter=2000, random_state=seed).fit(x, y)


def linear_probe(train_x: torch.Tensor, train_y: torch.Tensor, test_x: torch.Tensor, test_y: torch.Tensor,
                 num_classes: int, seed: int = 0) -> tuple[dict[str, float], float]:
    """Returns the metrics on the test features and the chosen C."""
    from sklearn.model_selection import train_test_split

    x, y = train_x.numpy(), train_y.numpy()
    counts = np.bincount(y)
    stratify = y if counts[counts > 0].min() >= 2 else None
    xa, xv, ya, yv = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=stratify)
    scores = {c: (_fit(xa, ya, c, seed).predict(xv) == yv).mean() for c in C_GRID}
    best = max(C_GRID, key=lambda c: (scores[c], -c))
    clf = _fit(x, y, best, seed)
    logits = np.full((len(test_y), num_classes), -np.inf)
    logits[:, clf.classes_] = clf.predict_log_proba(test_x.numpy())
    m = classification_metrics(torch.from_numpy(logits), test_y, num_classes)
    return {f"lp_{k}": v for k, v in m.items()}, best


def run(model, preprocess, tokenizer, splits: tuple[EvalDataset, EvalDataset], ctx: EvalContext) -> dict:
    """Task ``linear_probe`` on the train and test splits."""
    f = probe_features(model, preprocess, splits, ctx)
    metrics: dict[str, float] = {}
    extra: dict[str, float] = {"n_train": len(f.train_labels)}
    for suffix, tr, te in f.pairs:
        m, best_c = linear_probe(tr, f.train_labels, te, f.test_labels, f.classes)
        metrics.update({k + suffix: v for k, v in m.items()})
        extra[f"C{suffix}"] = best_c
    chance = suffixed_chance({f"lp_{k}": v for k, v in classification_chance(f.classes).items()}, f.pairs)
    return {"n": len(f.test_labels), "metrics": metrics, "chance": chance, **extra}
