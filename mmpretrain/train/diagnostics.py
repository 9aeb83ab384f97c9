"""Geometry diagnostics of a batch of embeddings (formulas: docs/methods.md, "Geometry
diagnostics") and the run's end-of-training plots.

``geometry(x, y)`` takes the image and text embeddings of the *global* batch (the trainer gathers them
from every rank first), L2-normalised, pairs on the diagonal."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

# rows the measures use at most: 4,096^2 float32 similarities are 64 MiB, where a 64k global batch
# would build 64k^2 (16 GiB in fp32, 32 in fp64) matrices for a diagnostic
GEOMETRY_ROWS = 4096


@torch.no_grad()
def geometry(x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """The measures of the first :data:`GEOMETRY_ROWS` pairs, in float32 (those of negatives need
    two pairs: a batch of one gives the others only)."""
    x, y = x[:GEOMETRY_ROWS].float(), y[:GEOMETRY_ROWS].float()
    B = x.shape[0]
    if B < 2:
        return {"align": float((x - y).pow(2).sum(1).mean()), "modality_gap": float((x.mean(0) - y.mean(0)).norm()),
                "pos_sim_mean": float((x * y).sum(1).mean())}
    off = ~torch.eye(B, dtype=torch.bool, device=x.device)

    def uniform(z: torch.Tensor) -> float:
        d2 = torch.cdist(z, z).pow(2)
        return float(torch.log(torch.exp(-2 * d2[off]).mean()))

    sim = x @ y.T
    neg = sim[off]
    threshold = -1 / (B - 1)
    return {
        "align": float((x - y).pow(2).sum(1).mean()),
        "uniform_image": uniform(x),
        "uniform_text": uniform(y),
        "modality_gap": float((x.mean(0) - y.mean(0)).norm()),
        "pos_sim_mean": float(sim.diagonal().mean()),
        "neg_sim_mean": float(neg.mean()),
        "neg_sim_var": float(neg.var(unbiased=False)),
        "excessive_separation": float(neg.mean() < threshold),  # 1.0 when the mean is below -1/(B-1)
        "below_separation_fraction": float((neg < threshold).float().mean()),
    }


# what each geometry measure's axis shows (formulas: docs/methods.md)
GEOMETRY_UNITS = {
    "align": "mean ||x - y||^2",
    "uniform_image": "log mean exp(-2 d^2)",
    "uniform_text": "log mean exp(-2 d^2)",
    "modality_gap": "||mean x - mean y||",
    "pos_sim_mean": "cosine",
    "neg_sim_mean": "cosine",
    "neg_sim_var": "cosine variance",
    "excessive_separation": "1 = mean below -1/(B-1)",
    "below_separation_fraction": "share of negatives",
}


def similarity_histogram(x: torch.Tensor, y: torch.Tensor, bins: int = 50) -> dict[str, list[float]]:
    """Histograms (densities over [-1, 1]) of positive and negative cosine similarities (first
    :data:`GEOMETRY_ROWS` pairs)."""
    sim = (x[:GEOMETRY_ROWS].float() @ y[:GEOMETRY_ROWS].float().T).cpu()
    off = ~torch.eye(sim.shape[0], dtype=torch.bool)
    pos = torch.histc(sim.diagonal(), bins, -1, 1)
    neg = torch.histc(sim[off], bins, -1, 1)
    return {"positive": (pos / pos.sum()).tolist(), "negative": (neg / neg.sum()).tolist()}


def plot_run(records: list[dict[str, Any]], histograms: dict[str, list[float]] | None, out: Path) -> list[Path]:
    """``loss.png`` (every term), ``lr_scale.png`` (learning rate and logit scale), ``geometry.png``
    (the diagnostics over training) and ``similarity.png`` (the last diagnostics batch's histograms)."""
    if not records:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths = []

    def series(key):
        pts = [(r["step"], r[key]) for r in records if key in r and r[key] is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    def save(fig, name, **margins):
        # fixed margins: tight_layout draws every figure once more to measure it (~0.4 s of the ~1.5 s)
        fig.subplots_adjust(**{"left": 0.12, "right": 0.97, "bottom": 0.13, "top": 0.92, **margins})
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        paths.append(out / name)

    fig, ax = plt.subplots(figsize=(6, 4))
    for k in sorted({k for r in records for k in r if k.endswith("_loss") or k == "loss"}):
        ax.plot(*series(k), label=k)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    save(fig, "loss.png")

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.5))
    a1.plot(*series("lr"))
    a1.set_title("learning rate")
    a1.set_ylabel("learning rate")
    a2.plot(*series("logit_scale"))
    a2.set_title("logit scale")
    a2.set_ylabel("exp(logit scale)")
    for a in (a1, a2):
        a.set_xlabel("step")
    save(fig, "lr_scale.png", left=0.13, wspace=0.45, bottom=0.15, top=0.9)

    geo = sorted({k for r in records for k in r if k.startswith("geometry/")})
    if geo:
        cols = 3
        rows = math.ceil(len(geo) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(10, 2.8 * rows), squeeze=False)
        for a, k in zip(axes.flat, geo):
            name = k.removeprefix("geometry/")
            a.plot(*series(k), marker=".", markersize=3)
            a.set_title(name, fontsize=9)
            a.set_xlabel("step", fontsize=8)
            a.set_ylabel(GEOMETRY_UNITS.get(name, name), fontsize=8)
        for a in list(axes.flat)[len(geo):]:
            a.axis("off")
        save(fig, "geometry.png", left=0.1, right=0.98, bottom=0.3 / rows, top=1 - 0.25 / rows, wspace=0.6,
             hspace=0.7)

    if histograms:
        edges = torch.linspace(-1, 1, len(histograms["positive"]) + 1)
        centres = ((edges[1:] + edges[:-1]) / 2).tolist()
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(centres, histograms["positive"], label="positive pairs")
        ax.plot(centres, histograms["negative"], label="negative pairs")
        ax.set_xlabel("cosine similarity (image, text)")
        ax.set_ylabel("share")
        ax.legend()
        save(fig, "similarity.png")
    return paths
