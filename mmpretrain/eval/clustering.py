"""Task ``clustering``: clustering measures ("Clustering Properties of Self-Supervised Learning", ICML 2025): k-means with
k = number of classes on the features -> adjusted Rand index against the labels; silhouette of the
true labels (cosine distance): mean and standard deviation over samples."""

from __future__ import annotations

import torch

from mmpretrain.eval.context import EvalContext
from mmpretrain.eval.datasets import EvalDataset
from mmpretrain.eval.features import image_features, num_classes


def clustering_metrics(x: torch.Tensor, y: torch.Tensor, num_classes: int, seed: int = 0) -> dict[str, float]:
    from sklearn.cluster import KMeans
    from sklearn.metrics import adjusted_rand_score, silhouette_samples

    xn, yn = x.numpy(), y.numpy()
    pred = KMeans(n_clusters=num_classes, n_init=10, random_state=seed).fit_predict(xn)
    out = {"ari": float(adjusted_rand_score(yn, pred))}
    if len(set(yn.tolist())) > 1:
        s = silhouette_samples(xn, yn, metric="cosine")
        out.update(silhouette_mean=float(s.mean()), silhouette_std=float(s.std()))
    return out


def run(model, preprocess, tokenizer, splits: tuple[EvalDataset | None, EvalDataset], ctx: EvalContext) -> dict:
    """Task ``clustering`` on the test split (projected and, where the tower has them, pre-projection features)."""
    x, pre, y = image_features(model, preprocess, splits[1], ctx)
    c = num_classes(splits[1], y)
    metrics = clustering_metrics(x, y, c)
    chance = {"ari": 0.0}  # the expected ARI of a random partition
    if pre is not None:
        metrics.update({f"{k}_preproj": v for k, v in clustering_metrics(pre, y, c).items()})
        chance["ari_preproj"] = 0.0
    return {"n": len(y), "metrics": metrics, "chance": chance}
