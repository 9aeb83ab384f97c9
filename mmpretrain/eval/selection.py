"""Task ``image_caption_selection`` (SugarCrepe, Winoground), as clip_benchmark 1.6.2 scores it.

Each instance has ``I`` images and ``C`` captions; with ``k = min(I, C)`` and ``S = X Y^T`` (normalised
image and caption features), an instance is

- ``text_acc``: right when every image ``i < k`` picks caption ``i`` (``argmax_j S_ij = i``): Winoground's
  *text score*, SugarCrepe's accuracy (its one image must prefer the true caption to the negative);
- ``image_acc``: right when every caption ``j < k`` picks image ``j`` (``argmax_i S_ij = j``): Winoground's
  *image score* (always 1 with one image, as in SugarCrepe);
- ``acc``: both: Winoground's *group score*.

Ties go to the lower index (``argmax``), as clip_benchmark decides them. Each metric is the float32
mean of the per-instance decisions, clip_benchmark's own computation, so the numbers are equal when the
decisions are. Chance: a uniformly random score matrix (Winoground: 1/4, 1/4, 1/6; SugarCrepe 1/2).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from functools import cache

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from tqdm.auto import tqdm

from mmpretrain.data.workers import loader_workers
from mmpretrain.eval.context import EvalContext, gather, gather_in_order
from mmpretrain.eval.selection_data import SelectionDataset


def decisions(scores: torch.Tensor) -> tuple[bool, bool]:
    """``(text right, image right)`` for one instance's ``(I, C)`` score matrix."""
    k = min(scores.shape)
    gt = torch.arange(k)
    text = bool((scores.argmax(dim=1)[:k].cpu() == gt).all())
    image = bool((scores.argmax(dim=0)[:k].cpu() == gt).all())
    return text, image


def selection_metrics(text: list[bool], image: list[bool]) -> dict[str, float]:
    both = [t and i for t, i in zip(text, image)]
    return {"image_acc": torch.Tensor(image).float().mean().item(),
            "text_acc": torch.Tensor(text).float().mean().item(),
            "acc": torch.Tensor(both).float().mean().item()}


@cache
def instance_chance(n_images: int, n_captions: int) -> tuple[float, float, float] | None:
    """``(image, text, both)`` probabilities under i.i.d. continuous random scores: exact, by the orderings
    of the ``I x C`` entries (None above 8 entries, where that count is not worth making)."""
    k = min(n_images, n_captions)
    if n_images * n_captions > 8:
        return None
    hits = Counter()
    cells = n_images * n_captions
    for ranks in itertools.permutations(range(cells)):
        s = torch.tensor(ranks, dtype=torch.float64).reshape(n_images, n_captions)
        text, image = decisions(s)
        hits["text"] += text
        hits["image"] += image
        hits["both"] += text and image
    total = math.factorial(cells)
    assert k >= 1
    return hits["image"] / total, hits["text"] / total, hits["both"] / total


class _Share(IterableDataset):
    """``(index, images (I, 3, H, W) or None, captions, reason)`` for this rank's and worker's instances."""

    def __init__(self, ds: SelectionDataset, preprocess, rank: int, world: int):
        self.ds, self.preprocess, self.rank, self.world = ds, preprocess, rank, world

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        for i, inst in self.ds.indexed(self.rank, self.world, part=wid, parts=nw):
            if inst.images is None:
                yield i, None, inst.captions, inst.reason
                continue
            yield i, torch.stack([self.preprocess(im) for im in inst.images]), inst.captions, None


def _collate(rows):
    return rows


@torch.no_grad()
def run(model, preprocess, tokenizer, ds: SelectionDataset, ctx: EvalContext) -> dict:
    ctx.skipped.update(ds.malformed if ctx.rank == 0 else {})  # counted once, at load
    share = _Share(ds, preprocess, ctx.rank, ctx.world_size)
    loader = DataLoader(share, batch_size=ctx.batch_size, collate_fn=_collate,
                        **loader_workers(ctx.num_workers, share, _collate))
    index, text_ok, image_ok, shapes = [], [], [], []
    total = math.ceil(len(ds) / ctx.world_size)
    with tqdm(total=total, desc=f"{ds.name} selection", unit="inst", disable=ctx.rank != 0, leave=False) as bar:
        for rows in loader:
            bar.update(len(rows))
            good = [r for r in rows if r[1] is not None]
            ctx.skipped.update(r[3] for r in rows if r[1] is None)
            if not good:
                continue
            images = torch.cat([r[1] for r in good]).to(ctx.device)
            img = model.encode_image(images, normalize=True).float()
            texts = [c for r in good for c in r[2]]
            txt = torch.cat([model.encode_text(tokenizer(texts[i:i + ctx.batch_size]).to(ctx.device),
                                               normalize=True).float()
                             for i in range(0, len(texts), ctx.batch_size)])
            i0 = t0 = 0
            for i, imgs, caps, _ in good:
                n_img, n_cap = imgs.shape[0], len(caps)
                text, image = decisions(img[i0:i0 + n_img] @ txt[t0:t0 + n_cap].T)
                i0, t0 = i0 + n_img, t0 + n_cap
                index.append(i)
                text_ok.append(text)
                image_ok.append(image)
                shapes.append((n_img, n_cap))
    local = {"text": torch.tensor(text_ok, dtype=torch.bool), "image": torch.tensor(image_ok, dtype=torch.bool),
             "shape": torch.tensor(shapes, dtype=torch.long).reshape(-1, 2)}
    out, _ = gather_in_order(local, torch.tensor(index, dtype=torch.long), ctx.world_size)
    n = sum(len(x) for x in gather(index, ctx.world_size))
    if not n:
        raise ValueError(f"{ds.name}: no instance could be evaluated (skipped: {dict(ctx.skipped)})")
    text, image = out["text"].tolist(), out["image"].tolist()
    chances = [instance_chance(*s) for s in map(tuple, out["shape"].tolist())]
    chance = {}
    if all(c is not None for c in chances):
        chance = {k: sum(c[j] for c in chances) / len(chances) for j, k in enumerate(("image_acc", "text_acc", "acc"))}
    return {"n": n, "metrics": selection_metrics(text, image), "chance": chance}
