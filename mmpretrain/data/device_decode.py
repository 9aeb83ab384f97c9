"""``data.decode=device``: JPEGs decoded, cropped and resized by the training device, not the loader workers.

The workers still read the shards, draw each sample's crop box (the same :class:`~mmpretrain.data.crop.
CropSampler` and seed as ``data.decode=worker``, so the boxes, in the original image's pixels, are the same
and an exact resume holds), tokenize and attach the sidecar rows; a JPEG the device decoder takes
(:func:`mmpretrain.data.jpeg.device_jpeg`: baseline or progressive Huffman, 8-bit, grey or YCbCr, a
complete file whose bytes can hold its frame) travels as its bytes and box instead of pixels. Any other
image (PNG, WebP, CMYK, an Adobe RGB transform, arithmetic coding, a truncated file) is decoded by the
worker as before, and so is the first image of every batch (its anchor), so a batch can mix both.

On the device (:class:`DeviceDecoder`) the batch's JPEGs are decoded with torchvision's batched
``decode_jpeg(..., device=...)`` in chunks of ``chunk`` images (full-size uint8: ~0.6 MB for 512 x 384),
each box cropped and resized to the model input with the worker's kernel (bicubic, antialiased) and
written into the batch's (B, H, W, 3) uint8 images, which ``DeviceNormalize`` then normalises. A chunk
whose batched decode raises is decoded image by image; an image the device cannot decode is decoded on
the host with the worker's code (counted ``device_decode_fallback``); one nothing can decode is an
``undecodable_image`` skip, and one whose decoded last block is libjpeg's grey fill a ``truncated_jpeg``
skip (mmpretrain/data/jpeg.py's rule, as on the worker path), whose slot repeats the batch's first good
sample -- at worst its anchor -- (counted ``repeated_in_batch``): every rank keeps its batch size. On CUDA, :class:`Prefetcher` decodes the next batch on a side stream
while the current step runs.
"""

from __future__ import annotations

import io
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from PIL import Image

from mmpretrain.data.crop import Box, ResizedCrop
from mmpretrain.data.jpeg import FILL, TruncatedJpeg, tail_box

#: the keys a batch carries for the device decoder (collate writes them, DeviceDecoder removes them)
KEYS = ("jpeg_bytes", "jpeg_offsets", "jpeg_slots", "jpeg_boxes")


def jpeg_fields(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The batch's device-decoded samples (items holding ``jpeg`` bytes and a ``box``): their bytes
    concatenated into one uint8 tensor, the offsets (n + 1), slots in the batch and boxes (top, left,
    height, width) in original pixels. Empty when every image was decoded by the worker."""
    slots = [i for i, it in enumerate(items) if "jpeg" in it]
    if not slots:
        return {}
    blobs = [items[i]["jpeg"] for i in slots]
    offsets = [0]
    for b in blobs:
        offsets.append(offsets[-1] + len(b))
    return {"jpeg_bytes": torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8),
            "jpeg_offsets": torch.tensor(offsets, dtype=torch.long),
            "jpeg_slots": torch.tensor(slots, dtype=torch.long),
            "jpeg_boxes": torch.tensor([list(items[i]["box"]) for i in slots], dtype=torch.long)}


# the per-sample fields a slot copies from another when its image cannot be decoded at all
_ROW_FIELDS = ("tokens", "target_embeddings", "labels", "sample_index", "teacher_image_embeddings",
               "teacher_text_embeddings")
_LIST_FIELDS = ("texts", "keys")


class DeviceDecoder:
    """Decodes a batch's JPEG fields on ``device`` into its ``images`` (moved to the device), in place."""

    def __init__(self, crop: ResizedCrop, device: torch.device | str, chunk: int = 256):
        from torchvision.transforms import InterpolationMode

        self.crop, self.device, self.chunk = crop, torch.device(device), max(1, int(chunk))
        self.checked = False
        self.interpolation = {Image.BICUBIC: InterpolationMode.BICUBIC, Image.BILINEAR: InterpolationMode.BILINEAR,
                              Image.NEAREST: InterpolationMode.NEAREST_EXACT}.get(crop.interpolation,
                                                                                 InterpolationMode.BICUBIC)

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        images = batch["images"].to(self.device, non_blocking=True)
        if not self.checked:  # the first batch: say so when the workers decoded more than its anchor image
            self.checked = True
            n = len(batch["jpeg_slots"]) if "jpeg_slots" in batch else 0
            if n < len(images) - 1:
                print(f"note: data.decode=device: {len(images) - 1 - n} of the first batch's {len(images)} images "
                      "were decoded by the loader workers (not baseline/progressive YCbCr or grey JPEGs: PNG, WebP, "
                      "CMYK, ...); only JPEGs are decoded on the device", file=sys.stderr)
        if "jpeg_bytes" not in batch:
            batch["images"] = images
            return batch
        data, offsets = batch.pop("jpeg_bytes"), batch.pop("jpeg_offsets").tolist()
        slots, boxes = batch.pop("jpeg_slots").tolist(), batch.pop("jpeg_boxes").tolist()
        blobs = [data[offsets[k]:offsets[k + 1]] for k in range(len(slots))]
        skipped = batch.setdefault("skipped", {})
        bad: dict[int, str] = {}  # slot -> why it has no image
        for c in range(0, len(slots), self.chunk):
            part = range(c, min(c + self.chunk, len(slots)))
            tails = []  # (slot, whether its last block is libjpeg's fill, on the device): one read per chunk
            for k, img in zip(part, self._decode([blobs[k] for k in part])):
                if img is None:  # the worker path's decode, on this thread
                    out = self._host(blobs[k], boxes[k])
                    if isinstance(out, str):
                        bad[slots[k]] = out
                        continue
                    skipped["device_decode_fallback"] = skipped.get("device_decode_fallback", 0) + 1
                else:
                    out = self._resize(img, boxes[k])
                    if out is None:
                        bad[slots[k]] = "undecodable_image"
                        continue
                    top, left, bottom, right = tail_box(img.shape[-2], img.shape[-1])
                    tails.append((slots[k], (img[:, top:bottom, left:right] == FILL).all()))
                images[slots[k]] = out
            if tails:
                for (slot, _), grey in zip(tails, torch.stack([t for _, t in tails]).tolist()):
                    if grey:  # jpeg.py's rule 2, as on the worker path
                        bad[slot] = "truncated_jpeg"
        batch["images"] = images
        if bad:
            _fill(batch, bad, skipped)
        return batch

    def _decode(self, blobs: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """(3, h, w) uint8 on the device per blob; None where the device decoder refuses it."""
        import torchvision.io as tio

        with warnings.catch_warnings():  # torchvision 0.29 deprecates its decoders for TorchCodec's (docs/usage.md)
            warnings.simplefilter("ignore", DeprecationWarning)
            try:
                return list(tio.decode_jpeg(blobs, mode=tio.ImageReadMode.RGB, device=self.device))
            except RuntimeError:
                out = []
                for b in blobs:  # the batch raised: one by one, to find the culprit(s)
                    try:
                        out.append(tio.decode_jpeg(b, mode=tio.ImageReadMode.RGB, device=self.device))
                    except RuntimeError:
                        out.append(None)
                return out

    def _resize(self, img: torch.Tensor, box: list[int]) -> torch.Tensor | None:
        from torchvision.transforms.v2 import functional as F

        top, left, h, w = box
        if img.shape[-2] < top + h or img.shape[-1] < left + w:  # decoded smaller than its header said
            return None
        out = F.resized_crop(img, top, left, h, w, list(self.crop.size), interpolation=self.interpolation,
                             antialias=True)
        return out.permute(1, 2, 0)

    def _host(self, blob: torch.Tensor, box: list[int]) -> torch.Tensor | str:
        """The worker path's decode of one image the device could not decode; why not if it cannot either."""
        try:
            img = Image.open(io.BytesIO(blob.numpy().tobytes()))
            return self.crop.apply(img, Box(*box)).to(self.device)
        except TruncatedJpeg:
            return "truncated_jpeg"
        except Exception:
            return "undecodable_image"


def _fill(batch: dict[str, Any], bad: dict[int, str], skipped: dict) -> None:
    """Each slot in ``bad`` (no usable image; the value: why) repeats the batch's first good sample, every
    field. The first image of a batch is decoded by the loader worker (``SampleDecoder``'s ``anchor``), so
    a batch always has one."""
    good = next((i for i in range(batch["images"].shape[0]) if i not in bad), None)
    if good is None:  # cannot happen with the stream's batches (their anchor); a hand-made batch
        raise ValueError("data.decode=device: no image of the batch could be decoded on the device or the host")
    for i, why in bad.items():
        batch["images"][i] = batch["images"][good]
        for k in _ROW_FIELDS:
            if isinstance(batch.get(k), torch.Tensor):
                batch[k][i] = batch[k][good]
        for k in _LIST_FIELDS:
            if k in batch:
                batch[k][i] = batch[k][good]
        skipped[why] = skipped.get(why, 0) + 1
    skipped["repeated_in_batch"] = skipped.get("repeated_in_batch", 0) + len(bad)


class Prefetcher:
    """Batches of ``loader`` decoded by ``decoder``; on CUDA the next batch is decoded on a side stream
    while the current step runs (the step's stream waits for that batch's event only)."""

    def __init__(self, loader, decoder: DeviceDecoder):
        self.it: Iterator = iter(loader)
        self.decoder = decoder
        self.cuda = decoder.device.type == "cuda"
        self.stream = torch.cuda.Stream(decoder.device) if self.cuda else None
        self.pending = None

    def _launch(self):
        batch = next(self.it)
        if not self.cuda:
            return batch, None
        with torch.cuda.stream(self.stream):
            batch = self.decoder(batch)
            event = torch.cuda.Event()
            event.record(self.stream)
        return batch, event

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, Any]:
        if not self.cuda:
            return self.decoder(next(self.it))
        if self.pending is None:
            self.pending = self._launch()
        batch, event = self.pending
        self.pending = self._launch()  # queued on the side stream behind this batch's decode
        main = torch.cuda.current_stream(self.decoder.device)
        main.wait_event(event)
        batch["images"].record_stream(main)  # allocated on the side stream, used on the main one
        return batch
