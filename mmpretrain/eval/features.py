"""Frozen image features for probes: projected (normalised) and pre-projection, rank-split and gathered."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmpretrain.eval.loop import batches, gather_in_order


@torch.no_grad()
def image_features(model, preprocess, ds, batch_size: int, device, num_workers: int = 0):
    """``(feats (N, D), preproj (N, P) or None, labels (N,))`` over the dataset's labelled samples, in
    dataset order, on every rank.

    Pre-projection features are the image tower's pooled output before its projection, available
    for open_clip ViT towers (``visual.proj``); other towers return None."""
    visual = model.visual
    has_proj = isinstance(getattr(visual, "proj", None), torch.Tensor)
    index, feats, pre, labels = [], [], [], []
    for idx, images, _, labs in batches(ds, preprocess, batch_size, num_workers, labelled_only=True,
                                        desc=f"{ds.name} features"):
        x = images.to(device)
        feats.append(model.encode_image(x, normalize=True).float().cpu())
        if has_proj:
            proj = visual.proj
            try:
                visual.proj = None
                pre.append(F.normalize(visual(x).float(), dim=-1).cpu())
            finally:
                visual.proj = proj
        index.append(idx)
        labels += labs
    local = {"feats": torch.cat(feats) if feats else torch.empty(0),
             "pre": torch.cat(pre) if pre else torch.empty(0),
             "labels": torch.tensor(labels, dtype=torch.long)}
    out, _ = gather_in_order(local, torch.cat(index) if index else torch.empty(0, dtype=torch.long))
    if out["labels"] is None:
        raise ValueError(f"{ds.name}: no labelled samples")
    return out["feats"], out["pre"], out["labels"]
