"""``data.decode=device``: JPEGs decoded, cropped and resized by the training device, not the loader workers.

The workers still read the shards, draw each sample's crop box (the same :class:`~mmpretrain.data.crop.
CropSampler` and seed as ``data.decode=worker``, so the boxes, in the original image's pixels, are the same
and an exact resume holds), tokenize and attach the sidecar rows. A JPEG the device takes -- a baseline
Huffman JPEG (:func:`mmpretrain.data.jpeg.device_jpeg`) whose box the worker would decode at full size
(:meth:`~mmpretrain.data.crop.ResizedCrop.jpeg_reduction` 1) -- travels as its bytes and box, with no
pixels: the batch's ``images`` hold only the worker-decoded ones, at ``image_slots``. The workers decode
everything else (progressive JPEGs, whose Huffman decoding torchvision runs on the host one image at a
time; JPEGs they decode at a DCT reduction, 4-64x fewer pixels; PNG, WebP, CMYK, ...) and the first
image of every batch (its anchor), so a batch can mix both.

On the device (:class:`DeviceDecoder`) a batch's JPEGs are decoded with torchvision's batched
``decode_jpeg(..., device=...)`` in chunks of ``chunk`` images; a chunk whose batched decode raises is
split in halves until the culprits are alone. Every box of a chunk is cropped and resized with the
worker's filter in a constant number of operations (:mod:`mmpretrain.data.resample`) straight to the
normalised float batch (B, 3, H, W), which is made on the device. An image the device cannot decode is
decoded on the host with the worker's code (counted ``device_decode_fallback``; if more than half of the
first batch's device-taken JPEGs need that, :class:`DeviceDecodeError` stops the run naming the cause);
one nothing can decode is an ``undecodable_image`` skip, and one whose decoded last block is libjpeg's
grey fill a ``truncated_jpeg`` skip (mmpretrain/data/jpeg.py's rule, as on the worker path), whose slot
repeats the batch's first good sample -- at worst its anchor -- (counted ``repeated_in_batch``): every rank
keeps its batch size. ``device_decoded`` counts the images the device decoded.

:class:`Prefetcher` runs the decoder on a background thread, one batch ahead of the step (a queue of
``depth`` batches), on its own CUDA stream; see its docstring for the stream rules.
"""

from __future__ import annotations

import io
import queue
import sys
import threading
import warnings
from collections.abc import Iterator

import torch
from PIL import Image

from mmpretrain.data.batch import Batch
from mmpretrain.data.crop import Box, ResizedCrop
from mmpretrain.data.jpeg import FILL, TruncatedJpeg, tail_box
from mmpretrain.data.resample import crop_resize, pad
from mmpretrain.data.transfer import to_device

# Set once, at import, not per call: warnings.catch_warnings on the decoding thread swaps the process-wide
# filters and showwarning under the training thread (Python documents it as not thread-safe), which the
# GPU check's sync count reads (resample.py does the same for nested tensors). torchvision 0.29
# deprecates its decoders for TorchCodec's (docs/config.md).
warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities of TorchVision",
                        category=DeprecationWarning)


class DeviceDecodeError(RuntimeError):
    """The device decoder does not work here (torchvision without nvJPEG, nvJPEG failing to start): the
    trainer reports it in one line with the fix and exits 1."""


def nvjpeg_backend(device: torch.device) -> str:
    """Which nvJPEG backend torchvision's batched decoder gets on ``device``: it asks for the hardware
    JPEG engine (A100, H100, ...) and takes the default backend (CUDA cores, Huffman on the host) where
    the GPU has none; probed here the same way, through the libnvjpeg torchvision loaded (after a first
    CUDA decode it is mapped into the process; before one, the first soname that loads: CUDA 13's, 12's).
    ``"n/a"`` off CUDA."""
    if device.type != "cuda":
        return "n/a"
    import ctypes

    loaded = loaded_library("libnvjpeg")
    lib = None
    for name in ([loaded] if loaded else ["libnvjpeg.so.13", "libnvjpeg.so.12", "libnvjpeg.so"]):
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    if lib is None:
        return "unknown (libnvjpeg not found)"
    handle = ctypes.c_void_p()
    status = lib.nvjpegCreateEx(3, None, None, 0, ctypes.byref(handle))  # NVJPEG_BACKEND_HARDWARE
    if status == 0:
        lib.nvjpegDestroy(handle)
        return f"hardware (the GPU's JPEG engine decodes baseline JPEGs in batches; {lib._name})"
    if status == 7:  # NVJPEG_STATUS_ARCH_MISMATCH
        return f"default (no JPEG engine on this GPU: Huffman decoding on the host, one image at a time; {lib._name})"
    return f"unknown (nvjpegCreateEx status {status}; {lib._name})"


def loaded_library(stem: str, maps: str = "/proc/self/maps") -> str | None:
    """The path of the shared library named ``stem*`` this process has mapped (Linux), else None."""
    try:
        with open(maps) as f:
            for line in f:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if path.rsplit("/", 1)[-1].startswith(stem + ".so"):
                    return path
    except OSError:
        return None
    return None


class DeviceDecoder:
    """Decodes a batch's JPEG fields on ``device`` and makes its ``images``: (B, 3, H, W) float32 on the
    device, normalised by ``normalize`` (a :class:`~mmpretrain.data.decode.DeviceNormalize`; None: pixel
    values 0-255), ``channels_last`` memory format if asked. In place; returns the batch."""

    def __init__(self, crop: ResizedCrop, device: torch.device | str, normalize=None, chunk: int = 256,
                 channels_last: bool = False, batched: bool | None = None):
        self.crop, self.device, self.chunk = crop, torch.device(device), max(1, int(chunk))
        self.normalize, self.channels_last = normalize, channels_last
        # the crop stage: batched (a constant number of operations: what a GPU needs) or image by image
        # with torchvision's native uint8 kernel (what a CPU does fastest: no launch cost, 20-50x fewer
        # flops than the dense products); default by the device
        self.batched = self.device.type != "cpu" if batched is None else batched
        self.batches = 0
        self.errors: list[str] = []  # what the device decoder raised, for DeviceDecodeError

    def __call__(self, batch: Batch) -> Batch:
        first = self.batches == 0
        self.batches += 1
        B = len(batch)
        out = torch.empty((B, 3, *self.crop.size), dtype=torch.float32, device=self.device,
                          memory_format=torch.channels_last if self.channels_last else torch.contiguous_format)
        jpeg, batch.jpeg = batch.jpeg, None
        if jpeg is None:  # every image decoded by the workers
            self._place(out, batch.images, None)
            batch.images = out
            return batch
        data, offsets = jpeg.data, jpeg.offsets.tolist()  # host tensors: no sync
        slots, boxes = jpeg.slots.tolist(), jpeg.boxes
        box_list = boxes.tolist()
        if batch.images is not None and len(batch.images):
            self._place(out, batch.images, jpeg.image_slots)
        if first and self.device.type == "cuda":
            print(f"note: data.decode=device: nvJPEG backend on {self.device}: {nvjpeg_backend(self.device)}; "
                  f"{len(slots)} of the first batch's {B} images are JPEGs the device takes", file=sys.stderr)
        skipped = batch.skipped
        bad: dict[int, str] = {}  # slot -> why it has no image
        hosted: list[tuple[int, torch.Tensor]] = []  # (slot, (H, W, 3) uint8) decoded on the host
        greys = []  # per chunk: (the chunk's slots, whether each image's last block is libjpeg's fill)
        decoded = 0
        for c in range(0, len(slots), self.chunk):
            part = list(range(c, min(c + self.chunk, len(slots))))
            imgs = self._decode([data[offsets[k]:offsets[k + 1]] for k in part])
            good = []
            for k, img in zip(part, imgs):
                box = box_list[k]
                if img is None:  # the worker path's decode, on this thread
                    res = self._host(data[offsets[k]:offsets[k + 1]], box)
                    if isinstance(res, str):
                        bad[slots[k]] = res
                    else:
                        hosted.append((slots[k], res))
                elif img.shape[-2] < box[0] + box[2] or img.shape[-1] < box[1] + box[3]:
                    bad[slots[k]] = "undecodable_image"  # decoded smaller than its header said
                else:
                    good.append((k, img))
            if not good:
                continue
            decoded += len(good)
            chunk_slots = [slots[k] for k, _ in good]
            greys.append((chunk_slots, self.crop_stage(out, [img for _, img in good], boxes[[k for k, _ in good]],
                                                       torch.tensor(chunk_slots, dtype=torch.long))))
        if greys:  # one read of the device for the whole batch (on the decoding thread, not the step's)
            for (chunk_slots, _), grey in zip(greys, torch.cat([g for _, g in greys]).cpu().split(
                    [len(s) for s, _ in greys])):
                for slot, g in zip(chunk_slots, grey.tolist()):
                    if g:  # jpeg.py's rule 2, as on the worker path
                        bad[slot] = "truncated_jpeg"
                        decoded -= 1
        if hosted:
            skipped["device_decode_fallback"] = skipped.get("device_decode_fallback", 0) + len(hosted)
            self._place(out, torch.stack([img for _, img in hosted]), torch.tensor([s for s, _ in hosted]))
            if first and 2 * len(hosted) > len(slots):
                why = self.errors[0] if self.errors else "no error given"
                raise DeviceDecodeError(
                    f"data.decode=device: {len(hosted)} of the first batch's {len(slots)} device-taken JPEGs could "
                    f"not be decoded on {self.device} and were decoded on the host instead ({why}): torchvision "
                    "without nvJPEG, or nvJPEG failing to start; set data.decode=worker (or install a torchvision "
                    "built with nvJPEG for this CUDA)")
        if decoded:
            skipped["device_decoded"] = skipped.get("device_decoded", 0) + decoded
        batch.images = out
        if bad:
            _fill(batch, bad, skipped)
        return batch

    def crop_stage(self, out: torch.Tensor, images: list[torch.Tensor], boxes: torch.Tensor,
                   slots: torch.Tensor) -> torch.Tensor:
        """Decoded ``images`` ((3, h, w) uint8 on the device) cropped to ``boxes`` (n, 4: host), resized,
        normalised into ``out`` at ``slots`` (host): a constant number of operator calls whatever n.
        Returns (n,) bool on the device: whether each image's last block is libjpeg's fill (rule 2)."""
        if not self.batched:
            return self._crop_each(out, images, boxes.tolist(), slots)
        padded = pad(images)
        self._put(out, slots, crop_resize(padded, boxes, self.crop.size, self.crop.interpolation))
        sizes = torch.tensor([img.shape[-2:] for img in images], dtype=torch.long)  # host: Python ints
        return _grey_tail(padded, to_device(sizes, self.device))

    def _crop_each(self, out: torch.Tensor, images: list[torch.Tensor], boxes: list[list[int]],
                   slots: torch.Tensor) -> torch.Tensor:
        """The crop stage image by image with torchvision's antialiased ``resized_crop`` (on a CPU its
        native uint8 kernel); the tail check per image."""
        from torchvision.transforms import InterpolationMode
        from torchvision.transforms.v2 import functional as F

        mode = {Image.BICUBIC: InterpolationMode.BICUBIC, Image.BILINEAR: InterpolationMode.BILINEAR,
                Image.NEAREST: InterpolationMode.NEAREST_EXACT}.get(self.crop.interpolation, InterpolationMode.BICUBIC)
        pixels, greys = [], []
        for img, (top, left, h, w) in zip(images, boxes):
            pixels.append(F.resized_crop(img, top, left, h, w, list(self.crop.size), interpolation=mode, antialias=True))
            top, left, bottom, right = tail_box(img.shape[-2], img.shape[-1])
            greys.append((img[:, top:bottom, left:right] == FILL).all())
        self._put(out, slots, torch.stack(pixels).to(torch.float32))
        return torch.stack(greys)

    def _place(self, out: torch.Tensor, images: torch.Tensor, slots: torch.Tensor | None) -> None:
        """(n, H, W, 3) uint8 host images into ``out`` at ``slots`` (None: all of them), normalised."""
        x = to_device(images, self.device).permute(0, 3, 1, 2).to(torch.float32)
        self._put(out, slots, x)

    def _put(self, out: torch.Tensor, slots: torch.Tensor | None, pixels: torch.Tensor) -> None:
        """``pixels`` (n, 3, H, W) float 0-255 into ``out`` at ``slots``, normalised as DeviceNormalize does."""
        if self.normalize is not None:
            mean, std = self.normalize.on(pixels.device)
            pixels = pixels.div(255).sub_(mean).div_(std)
        if slots is None:
            out.copy_(pixels)
        else:
            out.index_copy_(0, to_device(slots, self.device), pixels)

    def _decode(self, blobs: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """(3, h, w) uint8 on the device per blob; None where the device decoder refuses it. A batch that
        raises is split in halves until each culprit is alone (log2 of the chunk calls per bad image)."""
        import torchvision.io as tio

        try:
            return list(tio.decode_jpeg(blobs, mode=tio.ImageReadMode.RGB, device=self.device))
        except RuntimeError as e:
            if len(blobs) == 1:
                if len(self.errors) < 4:
                    self.errors.append(str(e).strip().splitlines()[-1][:200] if str(e).strip() else type(e).__name__)
                return [None]
        half = len(blobs) // 2
        return self._decode(blobs[:half]) + self._decode(blobs[half:])

    def _host(self, blob: torch.Tensor, box: list[int]) -> torch.Tensor | str:
        """The worker path's decode of one image the device could not decode; why not if it cannot either."""
        try:
            img = Image.open(io.BytesIO(blob.numpy().tobytes()))
            return self.crop.apply(img, Box(*box))
        except TruncatedJpeg:
            return "truncated_jpeg"
        except Exception:
            return "undecodable_image"


def _grey_tail(padded: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """(N,) bool on the device: whether each image's last 8 x 8 block (its frame's bottom-right block, as
    :func:`mmpretrain.data.jpeg.tail_box`) is exactly libjpeg's fill in every channel. ``sizes``: (N, 2)
    decoded heights and widths; a gather of N x 3 x 8 x 8 pixels."""
    h, w = sizes[:, 0], sizes[:, 1]
    d = torch.arange(8, device=padded.device)
    ys = torch.minimum((h - 1) // 8 * 8, h - 1)[:, None] + d[None, :]  # (N, 8): rows of the last block
    xs = ((w - 1) // 8 * 8)[:, None] + d[None, :]
    ys, xs = torch.minimum(ys, (h - 1)[:, None]), torch.minimum(xs, (w - 1)[:, None])  # its visible part
    n = torch.arange(padded.shape[0], device=padded.device)[:, None, None, None]
    c = torch.arange(3, device=padded.device)[None, :, None, None]
    tail = padded[n, c, ys[:, None, :, None], xs[:, None, None, :]]  # (N, 3, 8, 8)
    return (tail == FILL).flatten(1).all(1)


def _fill(batch: Batch, bad: dict[int, str], skipped: dict) -> None:
    """Each slot in ``bad`` (no usable image; the value: why) repeats the batch's first good sample, every
    field. The first image of a batch is decoded by the loader worker (``SampleDecoder``'s ``anchor``), so
    a batch always has one."""
    good = next((i for i in range(batch.images.shape[0]) if i not in bad), None)
    if good is None:  # cannot happen with the stream's batches (their anchor); a hand-made batch
        raise ValueError("data.decode=device: no image of the batch could be decoded on the device or the host")
    for i, why in bad.items():
        batch.copy_row(i, good)
        skipped[why] = skipped.get(why, 0) + 1
    skipped["repeated_in_batch"] = skipped.get("repeated_in_batch", 0) + len(bad)


_DONE = object()


class Prefetcher:
    """Batches of ``loader`` decoded by ``decoder`` on a background thread, up to ``depth`` batches ahead
    of the training thread (torch's ops release the GIL, so decoding and cropping batch n + 1 overlap step
    n: a step costs max(decode, step), not their sum).

    On CUDA the thread works on its own stream and synchronises it before each batch: torchvision's
    decoder allocates its outputs on the caller's stream while nvJPEG writes them on its own, so without
    the wait a decode could land in memory that queued crops of the previous batch still read. Each
    batch is handed over with an event the training thread's stream waits on (the step waits for its own
    batch only), and its images are recorded on that stream for the allocator. An exception in the
    thread (a loader error, :class:`DeviceDecodeError`) is raised in the training thread, as it was
    raised, at the batch it belongs to."""

    def __init__(self, loader, decoder: DeviceDecoder, depth: int = 2):
        self.it: Iterator = iter(loader)
        self.decoder = decoder
        self.cuda = decoder.device.type == "cuda"
        self.stream = torch.cuda.Stream(decoder.device) if self.cuda else None
        self.queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._work, name="mmpretrain-device-decode", daemon=True)
        self.thread.start()

    def _work(self) -> None:
        try:
            while not self.stopping.is_set():
                try:
                    batch = next(self.it)
                except StopIteration:
                    self._hand(_DONE)
                    return
                if self.cuda:
                    with torch.cuda.device(self.decoder.device), torch.cuda.stream(self.stream):
                        self.stream.synchronize()
                        self.decoder(batch)
                        event = torch.cuda.Event()
                        event.record(self.stream)
                else:
                    self.decoder(batch)
                    event = None
                self._hand((batch, event))
        except BaseException as e:  # noqa: BLE001 -- re-raised in the training thread
            self._hand(e)

    def _hand(self, item) -> None:
        while not self.stopping.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        item = self.queue.get()
        if item is _DONE:
            self.queue.put(_DONE)
            raise StopIteration
        if isinstance(item, BaseException):
            self.close()
            raise item
        batch, event = item
        if event is not None:
            main = torch.cuda.current_stream(self.decoder.device)
            main.wait_event(event)
            batch.images.record_stream(main)  # made on the decoding stream, used on this one
        return batch

    def close(self) -> None:
        """Stop the thread (it may finish the batch it is on)."""
        self.stopping.set()
        try:
            while True:
                self.queue.get_nowait()
        except queue.Empty:
            pass
