"""Raw sample -> training item: image tensor, caption, key, stored caption embedding, label.

A sample that cannot be used raises :class:`SkipSample` with the reason the stream counts it under.
:func:`parse_label` is the one reader of a sample's class label (webdataset's ``cls`` member, else
``label`` in its ``json``), shared with the evaluation datasets.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import random
import warnings
from collections.abc import Collection
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from PIL import Image

from mmpretrain.data.crop import Box, ResizedCrop, fast_train_transform
from mmpretrain.data.jpeg import TruncatedJpeg, check_tail, device_jpeg, read_frame, too_short
from mmpretrain.data.naflex import normalize_patches
from mmpretrain.data.sidecar import IN_TAR, read_row

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")


class KeepImage:
    """``data.naflex``'s loader transform: the decoded RGB image as it is (collate resizes it to the grid of
    its batch's sequence length, :mod:`mmpretrain.data.naflex`)."""

    def __call__(self, img: Image.Image) -> Image.Image:
        return img


class SkipSample(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def parse_label(raw: dict[str, Any]) -> int | None:
    """The class index of a raw sample: its ``cls`` member, else an integer ``label`` in its ``json``;
    None when absent or unreadable."""
    try:
        if "cls" in raw:
            return int(raw["cls"].decode().strip())
        if "json" in raw:
            label = json.loads(raw["json"]).get("label")
            return label if isinstance(label, int) and not isinstance(label, bool) else None
    except (ValueError, UnicodeDecodeError, AttributeError):
        pass
    return None


class DeviceNormalize:
    """The last two steps of open_clip's image transform (to a float tensor in [0, 1], then
    ``Normalize(mean, std)``) on the device instead of in the loader: the loader's batches stay uint8,
    a quarter of the bytes through shared memory and host-to-device copies. The same operations in
    the same order as torchvision's (``float().div(255)``, then ``sub(mean).div(std)``), so the
    result is bit for bit the loader-side transform's."""

    def __init__(self, mean, std, channels_last: bool = False):
        self.mean = torch.as_tensor(mean, dtype=torch.float32).reshape(-1, 1, 1)
        self.std = torch.as_tensor(std, dtype=torch.float32).reshape(-1, 1, 1)
        self.channels_last = channels_last  # the loader hands over (B, H, W, C): permuted here, on the device

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mean, std)``, (3, 1, 1), on ``device`` (moved once)."""
        if self.mean.device != device:
            self.mean, self.std = self.mean.to(device), self.std.to(device)
        return self.mean, self.std

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        if images.dtype != torch.uint8:
            return images  # already normalised (a loader that kept the float transform, the device decoder)
        self.on(images.device)
        if images.dim() == 3:  # data.naflex: (B, L, P*P*3) patch sequences, the channel fastest
            return normalize_patches(images, self.mean, self.std)
        if self.channels_last:
            images = images.permute(0, 3, 1, 2)
        return images.to(torch.float32, memory_format=torch.contiguous_format).div(255).sub_(self.mean).div_(self.std)


def split_normalize(transform, fast: bool = False) -> tuple[Any, DeviceNormalize | None]:
    """``(uint8 transform, DeviceNormalize)`` from an open_clip/torchvision ``Compose`` ending in
    to-tensor + ``Normalize``: the augmentation stays in the loader and ends in ``PILToTensor``;
    ``(transform, None)`` for any other transform (kept whole). ``fast``: open_clip's plain training
    augmentation becomes a :class:`~mmpretrain.data.crop.ResizedCrop` (crop drawn before decoding, JPEG
    decoded reduced, (H, W, 3) batches permuted on the device)."""
    from torchvision import transforms as T

    steps = list(getattr(transform, "transforms", []))
    if len(steps) < 2 or not isinstance(steps[-1], T.Normalize) or type(steps[-2]).__name__ not in (
            "ToTensor", "MaybeToTensor"):
        return transform, None
    uint8 = T.Compose([*steps[:-2], T.PILToTensor()])
    crop = fast_train_transform(uint8) if fast else None
    if crop is not None:
        return crop, DeviceNormalize(steps[-1].mean, steps[-1].std, channels_last=True)
    return uint8, DeviceNormalize(steps[-1].mean, steps[-1].std)


def caption_pool(raw: dict[str, Any]) -> tuple[list[str], list[float] | None]:
    """A sample's extra captions (``captions`` in its ``json``: caption 0 stays in ``txt``) and the
    optional ``caption_weights``, one per caption with caption 0 first; ``([], None)`` without them.
    Raises :class:`SkipSample` ``bad_captions`` for a field that is not that."""
    if "json" not in raw:
        return [], None
    try:
        meta = json.loads(raw["json"])
    except (ValueError, UnicodeDecodeError):
        return [], None  # an unreadable json is no caption list (its label, if any, reads as unknown)
    extra = meta.get("captions") if isinstance(meta, dict) else None
    if extra is None:
        return [], None
    if not isinstance(extra, list) or not all(isinstance(c, str) and c.strip() for c in extra):
        raise SkipSample("bad_captions")
    weights = meta.get("caption_weights")
    if weights is not None:
        if (not isinstance(weights, list) or len(weights) != len(extra) + 1
                or not all(isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) and w >= 0
                           for w in weights) or not 0 < sum(weights) < math.inf):  # a sum can overflow
            raise SkipSample("bad_captions")
    return [c.strip() for c in extra], weights


def negative_pool(raw: dict[str, Any]) -> list[str]:
    """A sample's hard-negative captions (``negative_captions`` in its ``json``); [] without them. Raises
    :class:`SkipSample` ``bad_negative_captions`` for a field that is not a list of non-empty strings."""
    if "json" not in raw:
        return []
    try:
        meta = json.loads(raw["json"])
    except (ValueError, UnicodeDecodeError):
        return []
    negs = meta.get("negative_captions") if isinstance(meta, dict) else None
    if negs is None:
        return []
    if not isinstance(negs, list) or not all(isinstance(c, str) and c.strip() for c in negs):
        raise SkipSample("bad_negative_captions")
    return [c.strip() for c in negs]


def draw_caption(n: int, weights: list[float] | None, seed: int, epoch: int, key: str) -> int:
    """Which of a sample's ``n`` captions this epoch trains on: seeded by (seed, epoch, key) only, so a
    resumed or re-sharded run draws the same one (uniform, or by ``weights``)."""
    rng = random.Random(augmentation_seed(seed, epoch, key + "/caption"))
    return rng.choices(range(n), weights=weights)[0] if weights else rng.randrange(n)


def augmentation_seed(seed: int, epoch: int, key: str) -> int:
    h = hashlib.blake2b(f"{seed}:{epoch}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & (2**63 - 1)


@contextmanager
def bad_image_skips():
    """An image that cannot be decoded as a counted skip (decompression_bomb, truncated_jpeg,
    undecodable_image), never a crash; Pillow's bomb warning silenced (max_pixels is the cap that counts)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            yield
    except Image.DecompressionBombError:
        raise SkipSample("decompression_bomb") from None
    except TruncatedJpeg:
        raise SkipSample("truncated_jpeg") from None
    except SkipSample:
        raise
    except Exception:
        raise SkipSample("undecodable_image") from None


class SampleDecoder:
    """Raw sample -> dict(image tensor, caption, key, emb?, label?); raises :class:`SkipSample`.

    ``embeddings``: ``"require"`` (missing -> skip, counted), ``"optional"``, or ``"ignore"``.
    ``draft_size``: JPEGs are decoded at the smallest DCT scale still at least this large (Pillow's
    draft mode), which is most of the decoding cost saved for web images larger than the model input.
    ``needs``: the objective's (:data:`~mmpretrain.losses.base.NEEDS`); with ``labels`` the item holds the
    label (``-1`` when unknown), with ``negatives`` one of the sample's negative captions per epoch (None
    when it has none), with ``teacher`` the teacher's stored crop is replayed and its rows returned.
    ``embedding_dim``: the dimension the dataset records; a stored embedding that does not load, is not a
    finite float vector of that length, is a ``bad_embedding`` skip (never a crash, never a NaN loss).
    ``max_pixels``: larger images are ``too_many_pixels`` skips before their pixels are decoded (the
    build's cap against decompression bombs)."""

    def __init__(self, transform, embeddings: str = "optional", draft_size: int | None = None,
                 embedding_dim: int | None = None, max_pixels: int | None = 64_000_000, captions: str = "sample",
                 device_decode: bool = False, needs: Collection[str] = (), local_crops=None):
        self.transform = transform
        # self_distill: LocalCrops(count, size, scale), each cut from the stored image with its own seeded box
        self.local = None if local_crops is None else ResizedCrop(local_crops.size, local_crops.scale)
        self.local_count = 0 if local_crops is None else local_crops.count
        # objectives with hard_negatives: one of the sample's negative_captions per epoch (None: it has none)
        self.negatives = "negatives" in needs
        # objectives that distill from stored teacher rows: the crop is the teacher's, replayed (teacher.py)
        self.teacher = "teacher" in needs
        # data.decode=device: a JPEG the device decoder takes leaves as its bytes + crop box (device_decode.py)
        self.device_decode = device_decode and isinstance(transform, ResizedCrop)
        self.captions = captions  # "sample": one of caption 0 and the extra captions per epoch; "first": caption 0
        self.labels = "labels" in needs
        self.embeddings = embeddings
        self.draft_size = draft_size
        self.embedding_dim = embedding_dim
        self.max_pixels = max_pixels

    def __call__(self, raw: dict[str, Any], seed: int, epoch: int, anchor: bool = False) -> dict[str, Any]:
        """``anchor``: decode the image here even with ``data.decode=device`` (the first image of each
        batch, so that a batch always holds one image a device-undecodable slot can repeat)."""
        item = self._decode(raw, seed, epoch, anchor)
        if self.local is not None:
            item["local"] = self._local_crops(raw, seed, epoch)
        return item

    def _local_crops(self, raw: dict[str, Any], seed: int, epoch: int) -> torch.Tensor:
        """``(n, h, w, 3)`` uint8: the sample's local crops, crop ``i``'s box drawn from (seed, epoch, key, i), all
        from one decode of the stored image (a JPEG at the DCT reduction its smallest box allows)."""
        data = raw[next(e for e in IMAGE_EXTS if e in raw)]
        with bad_image_skips():
            img = Image.open(io.BytesIO(data))
            boxes = [self.local.box(img, augmentation_seed(seed, epoch, f"{raw['__key__']}/local{i}"))
                     for i in range(self.local_count)]
            smallest = min(boxes, key=lambda b: self.local.reduction(img, b))
            decoded, s = self.local.decode(img, smallest, self._check_pixels)
            return torch.stack([self.local.resize(decoded, b, s) for b in boxes])

    def _decode(self, raw: dict[str, Any], seed: int, epoch: int, anchor: bool = False) -> dict[str, Any]:
        ext = next((e for e in IMAGE_EXTS if e in raw), None)
        if ext is None:
            raise SkipSample("missing_image")
        if "txt" not in raw:
            raise SkipSample("missing_caption")
        try:
            caption = raw["txt"].decode("utf-8").strip()
        except UnicodeDecodeError:
            raise SkipSample("caption_not_utf8") from None
        if not caption:
            raise SkipSample("empty_caption")
        extra, weights = caption_pool(raw) if self.captions == "sample" else ([], None)
        pick = draw_caption(len(extra) + 1, weights, seed, epoch, raw["__key__"]) if extra else 0
        if pick:
            caption = extra[pick - 1]
        negative = None
        if self.negatives and (negs := negative_pool(raw)):
            negative = negs[draw_caption(len(negs), None, seed, epoch, raw["__key__"] + "/negative")]
        if self.negatives:
            raw = {**raw, "__negative__": negative}  # read by _item (a copy: the reader's raw is not changed)
        emb = None
        if self.embeddings != "ignore":
            rows = raw.get("__emb_extra__")
            if pick and rows is not None and len(rows) == len(extra):  # the drawn extra caption's sidecar row
                emb = torch.from_numpy(self._checked(rows[pick - 1]))
            elif pick:  # embedded before this caption list (or a list of another length): no row for it
                if self.embeddings == "require":
                    raise SkipSample("missing_embedding")
            elif raw.get("__emb__") is not None:  # the sidecar's row (mmpretrain.data.sidecar)
                emb = torch.from_numpy(self._checked(raw["__emb__"]))
            elif IN_TAR in raw:  # an in-tar member (the earlier layout)
                emb = torch.from_numpy(self._embedding(raw[IN_TAR]))
            elif self.embeddings == "require":
                raise SkipSample("missing_embedding")
        aug_seed = augmentation_seed(seed, epoch, raw["__key__"])
        teacher = self._teacher(raw, pick, len(extra), seed, epoch) if self.teacher else None
        data = raw[ext]
        frame = read_frame(data) if data[:2] == b"\xff\xd8" else None
        if frame is not None and too_short(frame, len(data)):  # both decode paths: jpeg.py's rule 1
            raise SkipSample("truncated_jpeg")
        if self.device_decode and ext in ("jpg", "jpeg") and not anchor:
            size = device_jpeg(data)
            # over the pixel cap at full size: the worker decodes it reduced (the cap counts drafted pixels)
            if size is not None and not (self.max_pixels and size[0] * size[1] > self.max_pixels):
                box = self.transform.sampler(*size, random.Random(aug_seed)) if teacher is None else \
                    self._replayed(teacher, *size)
                # a box the worker decodes at a DCT reduction stays with it (4-64x fewer pixels decoded)
                if self.transform.jpeg_reduction(box) == 1:
                    item = self._item(raw, caption, emb, None)  # no pixels: the device makes them
                    item.update(jpeg=raw[ext], box=box, **(teacher[1] if teacher else {}))
                    return item
        with bad_image_skips():
            img = Image.open(io.BytesIO(raw[ext]))
            if teacher is not None:  # the teacher's stored crop of this epoch, replayed
                image = self.transform.apply(img, self._replayed(teacher, img.width, img.height), self._check_pixels)
                return {**self._item(raw, caption, emb, image), **teacher[1]}
            if isinstance(self.transform, ResizedCrop):  # one pass: crop drawn, reduced decode, resize
                return self._item(raw, caption, emb, self.transform(img, aug_seed, self._check_pixels))
            (width, height), reduction = img.size, 1
            if self.draft_size and img.format == "JPEG" and img.draft("RGB", (self.draft_size, self.draft_size)):
                reduction = img.decoderconfig[0]  # the size below is the drafted one
            self._check_pixels(img)
            img.load()
            if frame is not None:
                check_tail(img, height, width, reduction)
            img = img.convert("RGB")
        # the CPU generator only: torch.manual_seed also seeds (lazily) every CUDA device, ~1 ms a call
        gen = torch.default_generator
        saved = gen.get_state()
        try:
            gen.manual_seed(aug_seed)
            image = self.transform(img)
        finally:
            gen.set_state(saved)
        return self._item(raw, caption, emb, image)

    def _teacher(self, raw: dict[str, Any], pick: int, n_extra: int, seed: int, epoch: int):
        """``(stored box (top, left, h, w, H, W), item fields)`` of the teacher crop this sample trains on
        this epoch: one of the K stored crops, drawn by (seed, epoch, sample index); its rows and the
        teacher's row of the caption drawn. Raises ``missing_teacher`` / ``bad_teacher_row``."""
        rows = raw.get("__teacher__")
        if rows is None or (pick and len(rows.extra) != n_extra):
            raise SkipSample("missing_teacher")
        k = rows.crops.shape[0] - 1
        a = 1 + random.Random(f"{seed}:{epoch}:{raw['__index__']}:teacher-crop").randrange(k)
        image = rows.image[a]
        text = rows.extra[pick - 1] if pick else rows.text
        if (rows.crops[a] < 0).any() or not (np.isfinite(image).all() and np.isfinite(text).all()):
            raise SkipSample("bad_teacher_row")
        box = (*(int(v) for v in rows.crops[a]), int(rows.crops[0][2]), int(rows.crops[0][3]))
        return box, {"teacher_image": torch.from_numpy(image.astype(np.float32)),
                     "teacher_text": torch.from_numpy(text.astype(np.float32))}

    @staticmethod
    def _replayed(teacher, width: int, height: int) -> Box:
        """The stored box, when it was drawn for an image of this size and lies inside it."""
        top, left, h, w, stored_h, stored_w = teacher[0]
        if (stored_h, stored_w) != (height, width) or top + h > height or left + w > width or min(h, w) <= 0:
            raise SkipSample("teacher_crop_mismatch")
        return Box(top, left, h, w)

    def _check_pixels(self, img: Image.Image) -> None:
        if self.max_pixels and img.width * img.height > self.max_pixels:
            raise SkipSample("too_many_pixels")

    def _item(self, raw: dict[str, Any], caption: str, emb, image: torch.Tensor | None) -> dict[str, Any]:
        out: dict[str, Any] = {"text": caption, "key": raw["__key__"]}
        if self.negatives:
            out["negative"] = raw.get("__negative__")
        if image is not None:  # None: a JPEG the device decodes (its bytes and box travel instead)
            out["image"] = image
        if emb is not None:
            out["emb"] = emb
        if self.labels:
            label = parse_label(raw)
            out["label"] = -1 if label is None else label
        return out

    def _embedding(self, data: bytes) -> np.ndarray:
        try:
            arr = read_row(data)
        except (ValueError, EOFError, OSError):  # empty, truncated, not .npy, an object array
            raise SkipSample("bad_embedding") from None
        return self._checked(arr)

    def _checked(self, arr: np.ndarray) -> np.ndarray:
        dim = self.embedding_dim
        if (arr.dtype.kind != "f" or arr.ndim != 1 or (dim is not None and arr.shape[0] != dim)
                or not np.isfinite(arr).all()):
            raise SkipSample("bad_embedding")
        return arr.astype(np.float32)
