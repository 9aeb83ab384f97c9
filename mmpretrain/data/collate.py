"""A batch from a reader's decoded samples (:func:`collate`), stacked into shared memory in a DataLoader
worker."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import get_worker_info

from mmpretrain.data.device_decode import jpeg_fields


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack``; in a DataLoader worker into shared memory directly, as torch's default collate
    does (a batch stacked in private memory is copied once more into shared memory to be handed over)."""
    if get_worker_info() is None:
        return torch.stack(tensors)
    first = tensors[0]
    storage = first.untyped_storage()._new_shared(len(tensors) * first.numel() * first.element_size())
    out = first.new_empty(0).set_(storage, 0, (len(tensors), *first.shape))
    return torch.stack(tensors, out=out)


def collate(items: list[dict[str, Any]], tokenizer=None) -> dict[str, Any]:
    """A batch: ``images (B, 3, H, W)``, ``texts``, ``keys``, ``sample_index (B,)`` (global, stable under
    resume, rank count and resampling), ``tokens (B, L)`` with a tokenizer, and ``target_embeddings
    (B, E)`` / ``labels (B,)`` when every item has one; with ``data.decode=device`` the JPEG fields of
    :func:`~mmpretrain.data.device_decode.jpeg_fields` (``images`` then holds the worker-decoded images
    only: the device makes the batch's image tensor)."""
    images = [it["image"] for it in items if "image" in it]
    batch: dict[str, Any] = {
        "texts": [it["text"] for it in items],
        "keys": [it["key"] for it in items],
        "sample_index": torch.tensor([it["index"] for it in items], dtype=torch.long),
    }
    if images:
        batch["images"] = _stack(images)
    if tokenizer is not None:
        batch["tokens"] = tokenizer(batch["texts"])
    if "negative" in items[0]:  # hard_negatives: one negative caption per sample, "" (masked) where it has none
        negs = [it["negative"] for it in items]
        batch["negative_mask"] = torch.tensor([n is not None for n in negs], dtype=torch.bool)
        if tokenizer is not None:
            batch["negative_tokens"] = tokenizer([n or "" for n in negs])
    if all("emb" in it for it in items):
        batch["target_embeddings"] = _stack([it["emb"] for it in items])
    if all("teacher_image" in it for it in items):  # stored teacher rows (mmpretrain.data.teacher)
        batch["teacher_image_embeddings"] = _stack([it["teacher_image"] for it in items])
        batch["teacher_text_embeddings"] = _stack([it["teacher_text"] for it in items])
    if all("label" in it for it in items):
        batch["labels"] = torch.tensor([it["label"] for it in items], dtype=torch.long)
    batch.update(jpeg_fields(items))  # data.decode=device: the JPEGs the trainer decodes
    return batch
