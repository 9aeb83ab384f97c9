"""Task ``knn``: weighted k-NN on frozen, L2-normalised features (cosine similarity), as in DINO's evaluation:
each of the k nearest training samples votes for its class with weight ``exp(sim / T)``, T = 0.07."""

from __future__ import annotations

import torch

from mmpretrain.eval.context import EvalContext
from mmpretrain.eval.datasets import EvalDataset
from mmpretrain.eval.features import probe_features, suffixed_chance


def knn_accuracy(train_x: torch.Tensor, train_y: torch.Tensor, test_x: torch.Tensor, test_y: torch.Tensor,
                 num_classes: int, k: int = 20, temperature: float = 0.07) -> float:
    """``train_x (N, D)``, ``test_x (M, D)`` normalised; returns top-1 accuracy."""
    k = min(k, train_x.shape[0])
    sim = test_x @ train_x.T
    top, idx = sim.topk(k, dim=1)
    votes = torch.zeros(test_x.shape[0], num_classes)
    votes.scatter_add_(1, train_y[idx], (top / temperature).exp())
    return (votes.argmax(1) == test_y).float().mean().item()


def run(model, preprocess, tokenizer, splits: tuple[EvalDataset, EvalDataset], ctx: EvalContext) -> dict:
    """Task ``knn`` on the train and test splits."""
    f = probe_features(model, preprocess, splits, ctx)
    metrics = {f"knn_acc1{suffix}": knn_accuracy(tr, f.train_labels, te, f.test_labels, f.classes)
               for suffix, tr, te in f.pairs}
    return {"n": len(f.test_labels), "metrics": metrics, "chance": suffixed_chance({"knn_acc1": 1 / f.classes}, f.pairs),
            "n_train": len(f.train_labels)}
