"""Task ``zeroshot_retrieval``: image-text retrieval recall@k, named as clip_benchmark names them:
``image_retrieval_recall@k`` (text query -> image) and ``text_retrieval_recall@k`` (image query ->
text; a hit if any of the image's captions is in the top k)."""

from __future__ import annotations

import math

import torch

from mmpretrain.eval.context import EvalContext, batches, cat_or_empty, gather_in_order
from mmpretrain.eval.datasets import EvalDataset


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
    n_txt = sum(captions_per_image)
    out = {}
    for k in ks:
        out[f"image_retrieval_recall@{k}"] = min(k, num_images) / num_images
        # P(at least one of c positives among k drawn from n_txt) averaged over images
        vals = [1 - math.comb(n_txt - c, min(k, n_txt)) / math.comb(n_txt, min(k, n_txt)) for c in captions_per_image]
        out[f"text_retrieval_recall@{k}"] = sum(vals) / len(vals)
    return out


@torch.no_grad()
def run(model, preprocess, tokenizer, ds: EvalDataset, ctx: EvalContext) -> dict:
    index, img_feats, txt_feats, counts = [], [], [], []
    for idx, images, captions, _ in batches(ds, preprocess, ctx, desc=f"{ds.name} retrieval"):
        img_feats.append(model.encode_image(images.to(ctx.device), normalize=True).float().cpu())
        texts = [c for caps in captions for c in caps]
        for i in range(0, len(texts), ctx.batch_size):
            tok = tokenizer(texts[i:i + ctx.batch_size]).to(ctx.device)
            txt_feats.append(model.encode_text(tok, normalize=True).float().cpu())
        counts += [len(caps) for caps in captions]
        index.append(idx)
    # captions travel as one list per image so they stay with their image when sorted by index
    per_image_txt, start = [], 0
    flat = cat_or_empty(txt_feats)
    for n in counts:
        per_image_txt.append(flat[start:start + n])
        start += n
    local = {"images": cat_or_empty(img_feats), "texts": per_image_txt}
    out, _ = gather_in_order(local, cat_or_empty(index, torch.long), ctx.world_size)
    per_image = [len(t) for t in out["texts"]]
    if out["images"] is None or not sum(per_image):
        raise ValueError(f"{ds.name}: no captions for retrieval: its samples need a txt member (one caption "
                         "per line); zeroshot_classification, linear_probe, knn and clustering need none")
    owner = torch.tensor([i for i, n in enumerate(per_image) for _ in range(n)])
    texts = torch.cat([t for t in out["texts"] if len(t)])
    image_features = out["images"]
    ks = list(ctx.recall_k)
    return {"n": image_features.shape[0],
            "metrics": retrieval_metrics(image_features, texts, owner, ks),
            "chance": retrieval_chance(image_features.shape[0], [c for c in per_image if c > 0] or [1], ks)}
