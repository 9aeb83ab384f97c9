"""Regions for the region-weighted objective (regions.py): scikit-learn k-means of a bank of embeddings,
warm-started from the previous centroids, the new centroids matched to the old ones (so that each
region keeps its identity and its Hedge weight), and each row's nearest centroid."""

from __future__ import annotations

import torch


def nearest(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Index of the nearest centroid (squared Euclidean) for each row of ``x``."""
    return ((centroids * centroids).sum(1)[None, :] - 2 * x @ centroids.T).argmin(1)


def kmeans(bank: torch.Tensor, m: int, init: torch.Tensor | None, iters: int, seed: int) -> torch.Tensor:
    """scikit-learn k-means of ``bank (n, d)`` into ``m`` centroids, warm-started from ``init``."""
    from sklearn.cluster import KMeans

    data = bank.detach().float().cpu().numpy()
    start = "k-means++" if init is None else init.detach().float().cpu().numpy()
    km = KMeans(n_clusters=m, init=start, n_init=1, max_iter=iters, random_state=seed, algorithm="lloyd")
    km.fit(data)
    return torch.from_numpy(km.cluster_centers_).to(bank.device, bank.dtype)


def match(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``new`` reordered so that row ``k`` is the new centroid assigned to old centroid ``k``
    (minimum total squared distance)."""
    from scipy.optimize import linear_sum_assignment

    cost = torch.cdist(old.double().cpu(), new.double().cpu()).pow(2).numpy()
    rows, cols = linear_sum_assignment(cost)
    order = torch.as_tensor(cols[rows.argsort()], device=new.device)
    return new[order]
