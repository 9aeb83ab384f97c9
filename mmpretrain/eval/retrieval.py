"""Image-text retrieval recall@k, named as clip_benchmark names them:
``image_retrieval_recall@k`` (text query -> image) and ``text_retrieval_recall@k`` (image query ->
text; a hit if any of the image's captions is in the top k)."""

from __future__ import annotations

import torch


def retrieval_metrics(image_features: torch.Tensor, text_features: torch.Tensor, text_to_image: torch.Tensor,
                      ks: list[int]) -> dict[str, float]:
    """``image_features (N, D)``, ``text_features (T, D)`` normalised; ``text_to_image (T,)`` the image
    index of each caption."""
    sim = text_features @ image_features.T  # (T, N)
    n_img = image_features.shape[0]
    out: dict[str, float] = {}
    positives = torch.zeros_like(sim, dtype=torch.bool)
    positives[torch.arange(sim.shape[0]), text_to_image] = True
    for k in ks:
        kk = min(k, n_img)
        top_img = sim.topk(kk, dim=1).indices  # (T, kk)
        out[f"image_retrieval_recall@{k}"] = positives.gather(1, top_img).any(1).float().mean().item()
        kt = min(k, sim.shape[0])
        top_txt = sim.T.topk(kt, dim=1).indices  # (N, kt)
        out[f"text_retrieval_recall@{k}"] = positives.T.gather(1, top_txt).any(1).float().mean().item()
    return out


def retrieval_chance(num_images: int, captions_per_image: list[int], ks: list[int]) -> dict[str, float]:
    """Expected recall of a uniformly random ranking."""
    import math

    n_txt = sum(captions_per_image)
    out = {}
    for k in ks:
        out[f"image_retrieval_recall@{k}"] = min(k, num_images) / num_images
        # P(at least one of c positives among k drawn from n_txt) averaged over images
        vals = [1 - math.comb(n_txt - c, min(k, n_txt)) / math.comb(n_txt, min(k, n_txt)) for c in captions_per_image]
        out[f"text_retrieval_recall@{k}"] = sum(vals) / len(vals)
    return out
