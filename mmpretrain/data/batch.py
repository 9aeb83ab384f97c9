"""The training batch: one typed record, :class:`Batch`, made here and nowhere else (:func:`collate`, in a
DataLoader worker, from a reader's decoded samples).

A per-sample field is declared once, below, with the decoded item's key it is collated from and, when an
objective asks for it, the need it serves (:data:`mmpretrain.losses.base.NEEDS`): the training task
(:mod:`mmpretrain.train.task`) hands every field of a need the objective declares to its forward as a
keyword of the field's name, and the device decoder copies every per-sample field when it repeats a slot.
Adding a batch field for an objective is then its declaration here, its producer (the item key in
:class:`~mmpretrain.data.decode.SampleDecoder`) and the objective's ``needs``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch.utils.data import get_worker_info

from mmpretrain.data.naflex import image_patches, pack


def _row(item: str | None, need: str | None = None, dtype: torch.dtype | None = None, doc: str = ""):
    """A per-sample field: collated from the items' ``item`` values (stacked tensors, or a ``dtype`` tensor
    of numbers) when every item has one; ``need``: the objective need it serves (``doc``: what it holds)."""
    return field(default=None, metadata={"row": True, "item": item, "need": need, "dtype": dtype, "doc": doc})


@dataclass
class JpegFields:
    """``data.decode=device``: the batch's JPEGs the device decodes (items holding ``jpeg`` bytes and a
    ``box``, and no ``image``): ``data`` their bytes concatenated (uint8), ``offsets (n + 1,)``, ``slots
    (n,)`` in the batch, ``boxes (n, 4)`` (top, left, height, width in original pixels), and
    ``image_slots``: the slots of the worker-decoded images, in the order of the batch's ``images``."""

    data: torch.Tensor
    offsets: torch.Tensor
    slots: torch.Tensor
    boxes: torch.Tensor
    image_slots: torch.Tensor

    @classmethod
    def of(cls, items: list[dict[str, Any]]) -> JpegFields | None:
        """The items' device-decoded samples, or None when the workers decoded every image."""
        slots = [i for i, it in enumerate(items) if "jpeg" in it]
        if not slots:
            return None
        blobs = [items[i]["jpeg"] for i in slots]
        offsets = [0]
        for b in blobs:
            offsets.append(offsets[-1] + len(b))
        return cls(torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8),
                   torch.tensor(offsets, dtype=torch.long), torch.tensor(slots, dtype=torch.long),
                   torch.tensor([list(items[i]["box"]) for i in slots], dtype=torch.long),
                   torch.tensor([i for i, it in enumerate(items) if "image" in it], dtype=torch.long))


@dataclass
class Batch:
    """A batch of ``B`` samples. ``images (B, 3, H, W)``: uint8 or float from the workers (with
    ``data.decode=device`` the worker-decoded ones only until the device decoder makes the whole tensor
    from ``jpeg``); ``tokens (B, L)`` with a tokenizer; ``sample_index (B,)`` global, stable under resume,
    rank count and resampling. The stream adds where the batch comes from: ``epoch`` (0-based stream
    epoch), ``worker`` and its reader's ``cursor`` after it, and ``skipped`` samples by reason."""

    texts: list[str] = field(default_factory=list, metadata={"row": True})
    keys: list[str] = field(default_factory=list, metadata={"row": True})
    sample_index: torch.Tensor | None = _row(
        "index", need="sample_index", dtype=torch.long, doc="sample_index (B,): each sample's global index in the "
        "dataset (stable under resume, rank count and resampling; a resampled batch can hold one index twice)")
    images: torch.Tensor | None = _row("image")
    # data.naflex: images are uint8 patch sequences (B, L, P*P*3), with each patch's (row, column) and
    # which are real (mmpretrain.data.naflex); made from the items' images by collate
    patch_coord: torch.Tensor | None = _row(None)
    patch_valid: torch.Tensor | None = _row(None)
    tokens: torch.Tensor | None = _row(None)  # the tokenizer's, of texts
    target_embeddings: torch.Tensor | None = _row("emb")  # stored caption embeddings (need "targets")
    labels: torch.Tensor | None = _row("label", need="labels", dtype=torch.long,
                                       doc="labels (B,): class indices from the shards (-1 unknown)")
    teacher_image_embeddings: torch.Tensor | None = _row(
        "teacher_image", need="teacher", doc="teacher_image_embeddings / teacher_text_embeddings (B, E): a stored "
        "teacher's embeddings of the crop trained on and of the caption trained with (an ensemble's members side "
        "by side), with teacher_dims, each member's width; the stream replays the teacher's stored crops")
    teacher_text_embeddings: torch.Tensor | None = _row("teacher_text", need="teacher")
    # self_distill's local crops, (B, n, h, w, 3) uint8, cut in the loader from the stored sample (decode.py)
    local_images: torch.Tensor | None = _row("local")
    negative_tokens: torch.Tensor | None = _row(None)  # the tokenizer's, of each sample's negative ("" if none)
    negative_mask: torch.Tensor | None = _row(
        None, need="negatives", doc="negative_mask (B,), which samples have a hard-negative caption "
        "(negative_captions in its json, one drawn per epoch), and negative_text_features (B, D), the text "
        "tower's features of it (negative_tokens go through the captions' text pass)")
    jpeg: JpegFields | None = None
    epoch: int = 0
    worker: int = 0
    cursor: list[int] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.keys)

    def for_needs(self, needs) -> dict[str, torch.Tensor]:
        """The fields serving ``needs`` (present ones), by field name: the objective's keywords."""
        return {f.name: v for f in fields(self) if f.metadata.get("need") in needs
                and (v := getattr(self, f.name)) is not None}

    def copy_row(self, dst: int, src: int) -> None:
        """Sample ``src``'s values into slot ``dst``, every per-sample field (the images too)."""
        for f in fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("row") and value is not None:
                value[dst] = value[src]

    def pin_memory(self) -> Batch:
        """A copy with its tensors in page-locked memory (the DataLoader's pin thread calls this)."""
        def pin(v):
            return v.pin_memory() if isinstance(v, torch.Tensor) else v
        out = replace(self, **{f.name: pin(getattr(self, f.name)) for f in fields(self)})
        if self.jpeg is not None:
            out.jpeg = replace(self.jpeg, **{f.name: pin(getattr(self.jpeg, f.name)) for f in fields(self.jpeg)})
        return out


def batch_needs() -> dict[str, str]:
    """The needs batch fields serve, each with what its fields hold (the first field's ``doc``)."""
    out: dict[str, str] = {}
    for f in fields(Batch):
        if f.metadata.get("need"):
            out.setdefault(f.metadata["need"], f.metadata["doc"])
    return out


def _shared(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """An empty tensor in shared memory in a DataLoader worker (None elsewhere: made where it is filled)."""
    if get_worker_info() is None:
        return None
    n = 1
    for d in shape:
        n *= d
    storage = torch.UntypedStorage._new_shared(n * torch.empty((), dtype=dtype).element_size())
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack``; in a DataLoader worker into shared memory directly, as torch's default collate
    does (a batch stacked in private memory is copied once more into shared memory to be handed over)."""
    if get_worker_info() is None:
        return torch.stack(tensors)
    first = tensors[0]
    storage = first.untyped_storage()._new_shared(len(tensors) * first.numel() * first.element_size())
    out = first.new_empty(0).set_(storage, 0, (len(tensors), *first.shape))
    return torch.stack(tensors, out=out)


def collate(items: list[dict[str, Any]], tokenizer=None, seq_len: int = 0, patch_size: int = 0) -> Batch:
    """The :class:`Batch` of decoded items (:class:`~mmpretrain.data.decode.SampleDecoder`'s dicts): each
    declared field from its item key when every item has one; ``images`` from the items that have one
    (``data.decode=device``: the rest travel as ``jpeg``); ``tokens`` with a tokenizer; with hard negatives
    (items with ``negative``, None where a sample has none) ``negative_mask`` and ``negative_tokens``.
    ``seq_len`` > 0 (``data.naflex``): the items' images (RGB PIL images) become ``seq_len`` patches of
    ``patch_size`` each, with ``patch_coord`` and ``patch_valid``."""
    batch = Batch(texts=[it["text"] for it in items], keys=[it["key"] for it in items])
    if seq_len:
        per = [image_patches(it["image"], seq_len, patch_size) for it in items]
        out = _shared((len(items), seq_len, per[0][0].shape[1]), torch.uint8)
        batch.images, batch.patch_coord, batch.patch_valid = pack([p for p, _ in per], [g for _, g in per], seq_len, out)
    for f in fields(Batch):
        item, dtype = f.metadata.get("item"), f.metadata.get("dtype")
        if item is None or (seq_len and item == "image"):
            continue
        if item == "image":  # partial with the device decoder
            values = [it["image"] for it in items if "image" in it]
        elif all(item in it for it in items):
            values = [it[item] for it in items]
        else:
            continue
        if values:
            setattr(batch, f.name, torch.tensor(values, dtype=dtype) if dtype is not None else _stack(values))
    if tokenizer is not None:
        batch.tokens = tokenizer(batch.texts)
    if "negative" in items[0]:  # hard_negatives: one negative caption per sample, "" (masked) where it has none
        negs = [it["negative"] for it in items]
        batch.negative_mask = torch.tensor([n is not None for n in negs], dtype=torch.bool)
        if tokenizer is not None:
            batch.negative_tokens = tokenizer([n or "" for n in negs])
    batch.jpeg = JpegFields.of(items)
    return batch
