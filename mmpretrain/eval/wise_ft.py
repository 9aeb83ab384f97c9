"""``mmpretrain.eval --interpolate [PRETRAINED] --alpha A [A ...]``: the WiSE-FT curve. The model's
weights are interpolated with PRETRAINED at each alpha (:mod:`mmpretrain.export.wise_ft`) and every
dataset evaluated, one results.json entry per dataset, task and alpha (model ``MODEL@alpha=A``). With
two datasets or more, the first is taken as the fine-tune's own domain and the rest as the original
(out-of-distribution) ones: the plot puts the first's headline score against the others' mean, one
point per alpha."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["sweep", "plot_curve"]


def sweep(model, alphas: list[float], pretrained: str, arch: str | None, evaluate_all) -> list[dict[str, Any]]:
    """``evaluate_all(tag)`` (a list of entries) at each alpha, the model's weights interpolated; the
    model's own weights are back afterwards."""
    import torch

    from mmpretrain.export.wise_ft import interpolate, pretrained_state

    own = {k: v.detach().clone() for k, v in model.state_dict().items()}
    pre = pretrained_state(pretrained, arch)
    interpolate(own, pre, 1.0, what=pretrained)  # the architecture check, before any evaluation
    entries = []
    try:
        for a in alphas:
            model.load_state_dict(interpolate(own, pre, a, what=pretrained), strict=True)
            for e in evaluate_all(f"@alpha={a:g}"):
                entries.append({**e, "wise_ft": {"alpha": a, "pretrained": pretrained}})
    finally:
        with torch.no_grad():
            model.load_state_dict(own, strict=True)
    return entries


def headline(entry: dict[str, Any]) -> tuple[str, float]:
    """The entry's first metric (acc1 for classification, image R@1 for retrieval)."""
    k = next(iter(entry["metrics"]))
    return k, float(entry["metrics"][k])


def plot_curve(entries: list[dict[str, Any]], path: Path) -> Path | None:
    """In-distribution (the first dataset) against out-of-distribution (the others' mean) per alpha."""
    rows: dict[float, dict[str, float]] = {}
    order: list[str] = []
    for e in entries:
        a = e["wise_ft"]["alpha"]
        key = f"{e['dataset']}/{e['task']}"
        if key not in order:
            order.append(key)
        rows.setdefault(a, {})[key] = headline(e)[1]
    if len(order) < 2 or len(rows) < 2:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    alphas = sorted(rows)
    x = [rows[a][order[0]] for a in alphas]
    y = [sum(rows[a][k] for k in order[1:]) / len(order[1:]) for a in alphas]
    fig, ax = plt.subplots(figsize=(4.5, 4))
    ax.plot(x, y, "o-")
    for a, xi, yi in zip(alphas, x, y):
        ax.annotate(f"α={a:g}", (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=8)
    metric = headline(entries[0])[0]
    ax.set_xlabel(f"in distribution: {order[0].split('/')[0]} {metric}", fontsize=9)
    ax.set_ylabel(f"out of distribution: mean {metric} of {len(order) - 1}", fontsize=9)
    ax.set_title("WiSE-FT, pretrained (α=0) to fine-tuned (α=1)\nOOD: "
                 + ", ".join(k.split("/")[0] for k in order[1:])[:80], fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
