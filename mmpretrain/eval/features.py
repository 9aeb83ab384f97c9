"""Frozen image features for probes: projected (normalised) and pre-projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.no_grad()
def image_features(model, preprocess, ds, batch_size: int, device, labelled_only: bool = True):
    """``(feats (N, D), preproj (N, P) or None, labels (N,))`` over the dataset's labelled samples.

    Pre-projection features are the image tower's pooled output before its projection, available
    for open_clip ViT towers (``visual.proj``); other towers return None."""
    visual = model.visual
    has_proj = isinstance(getattr(visual, "proj", None), torch.Tensor)
    feats, pre, labels = [], [], []
    images = []

    def flush():
        x = torch.stack(images).to(device)
        out = model.encode_image(x, normalize=True).float().cpu()
        feats.append(out)
        if has_proj:
            proj = visual.proj
            try:
                visual.proj = None
                pre.append(F.normalize(visual(x).float(), dim=-1).cpu())
            finally:
                visual.proj = proj
        images.clear()

    for s in ds:
        if labelled_only and s.label is None:
            continue
        images.append(preprocess(s.image))
        labels.append(s.label)
        if len(images) == batch_size:
            flush()
    if images:
        flush()
    if not labels:
        raise ValueError(f"{ds.name}: no labelled samples")
    return torch.cat(feats), (torch.cat(pre) if pre else None), torch.tensor(labels)
