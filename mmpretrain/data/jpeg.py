"""What a JPEG's markers say before any pixel is decoded, and the one rule both decode paths apply to a JPEG
whose data do not cover the frame its header declares.

**The rule** (a ``truncated_jpeg`` skip, on ``data.decode=worker`` and ``=device`` alike). libjpeg (Pillow,
torchvision's CPU decoder) decodes a file whose entropy-coded data run out before the last block -- a
download cut short that still ends in an EOI marker, or a header claiming 8000 x 8000 around 64 x 64 data
-- without an error: every block the data did not reach is filled with zero coefficients, mid-grey
(128, 128, 128). So a JPEG is skipped when

1. its bytes cannot hold the frame its header declares (:func:`too_short`: fewer than 2 bits a block for a
   sequential frame, 1 for a progressive one -- no Huffman code is shorter than 1 bit, and a sequential
   block needs a DC and an AC code), checked from the markers before decoding; or
2. once decoded (by either path, at any DCT reduction), its last block -- the image's bottom-right
   8 x 8 pixels, which lie in the last MCU whatever the chroma subsampling -- is exactly mid-grey in every
   channel (:func:`check_tail`; the device path compares :func:`tail_box` on the device): the data
   ran out before it.

A real image whose bottom-right block is exactly (128, 128, 128) is skipped too (flat mid-grey
graphics); a progressive JPEG cut after its first (DC) scan decodes to a blurrier whole picture and is
kept: its data do cover the frame.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

#: baseline and progressive Huffman frames: what nvJPEG (and torchvision's CPU decoder) take
DEVICE_SOF = {0xC0, 0xC2}
#: every other start-of-frame marker (extended, lossless, arithmetic, hierarchical)
OTHER_SOF = {0xC1, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
PROGRESSIVE_SOF = {0xC2, 0xC6, 0xCA, 0xCE}
FILL = 128  # the value libjpeg gives every sample of a block without coefficients


class Frame(NamedTuple):
    """A JPEG's frame header and where its first scan's data start."""

    sof: int  # the start-of-frame marker (0xC0 baseline, 0xC2 progressive, ...)
    precision: int
    width: int
    height: int
    sampling: tuple[tuple[int, int], ...]  # (horizontal, vertical) factor per component
    adobe_transform: int | None  # the Adobe APP14 marker's colour transform, if any
    scan_start: int  # offset of the first scan's entropy-coded data
    complete: bool  # the file ends in an EOI marker


def read_frame(data: bytes) -> Frame | None:
    """The frame of a JPEG from its markers (nothing decoded); None for anything that is not a JPEG with
    a frame header before its first scan."""
    n = len(data)
    if n < 4 or data[:2] != b"\xff\xd8":
        return None
    i, frame, adobe = 2, None, None
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # markers without a length
            i += 2
            continue
        length = struct.unpack(">H", data[i + 2:i + 4])[0]
        seg = data[i + 4:i + 2 + length]
        if length < 2 or len(seg) != length - 2:
            return None
        if marker == 0xEE and seg[:5] == b"Adobe" and len(seg) >= 12:
            adobe = seg[11]
        elif (marker in DEVICE_SOF or marker in OTHER_SOF) and frame is None:
            if len(seg) < 6:
                return None
            precision, height, width, comps = struct.unpack(">BHHB", seg[:6])
            if len(seg) < 6 + 3 * comps:
                return None
            sampling = tuple((seg[7 + 3 * c] >> 4, seg[7 + 3 * c] & 15) for c in range(comps))
            frame = (marker, precision, width, height, sampling)
        elif marker == 0xDA:  # start of scan: the headers are over
            if frame is None:
                return None
            return Frame(*frame, adobe, i + 2 + length, data[-2:] == b"\xff\xd9")
        i += 2 + length
    return None


def device_jpeg(data: bytes, progressive: bool = False) -> tuple[int, int] | None:
    """``(width, height)`` of a JPEG the device decoder takes, from its markers (no pixel decoded): a
    baseline Huffman frame (``progressive``: or a progressive one) of 8-bit samples, 1 (grey) or 3 (YCbCr)
    components, no Adobe APP14 marker declaring RGB or CMYK/YCCK, ending in EOI (a truncated file is left
    to the worker), whose bytes can hold its frame (:func:`too_short`). None for anything else.

    Progressive JPEGs stay with the workers by default: torchvision parses and Huffman-decodes them on the
    host, one image at a time with a device sync each, which the workers do in parallel and reduced."""
    f = read_frame(data)
    if (f is None or f.sof not in (DEVICE_SOF if progressive else {0xC0}) or f.precision != 8 or len(f.sampling) not in (1, 3) or not f.width
            or not f.height or not f.complete or too_short(f, len(data))):
        return None
    if f.adobe_transform is not None and len(f.sampling) == 3 and f.adobe_transform != 1:
        return None  # Adobe's "no transform": the components are RGB, not YCbCr
    return f.width, f.height


def too_short(frame: Frame, size: int) -> bool:
    """Rule 1: the file's bytes after its headers cannot code every block of the frame its header declares
    (at least 2 bits a block for a sequential frame, 1 for a progressive one; each component's own blocks,
    without the MCU padding, so the bound never exceeds what a real file needs)."""
    hmax = max(h for h, _ in frame.sampling) or 1
    vmax = max(v for _, v in frame.sampling) or 1
    blocks = sum(_ceil(_ceil(frame.width * h, hmax), 8) * _ceil(_ceil(frame.height * v, vmax), 8)
                 for h, v in frame.sampling)
    bits = 1 if frame.sof in PROGRESSIVE_SOF else 2
    return (size - frame.scan_start) * 8 < blocks * bits


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def tail_box(height: int, width: int, reduction: int = 1) -> tuple[int, int, int, int]:
    """``(top, left, bottom, right)``, in an image decoded at DCT ``reduction`` (1, 2, 4 or 8) from a
    ``height`` x ``width`` frame, of the frame's last 8 x 8 block (its visible part)."""
    return ((height - 1) // 8 * 8 // reduction, (width - 1) // 8 * 8 // reduction, _ceil(height, reduction),
            _ceil(width, reduction))


class TruncatedJpeg(Exception):
    """Rule 1 or 2 failed: the JPEG's data do not cover its frame (counted as ``truncated_jpeg``)."""


def check_tail(img, height: int, width: int, reduction: int = 1) -> None:
    """Rule 2 on a decoded Pillow image (grey or RGB: libjpeg's fill is mid-grey in both) of a ``height`` x
    ``width`` frame: raises :class:`TruncatedJpeg` when the frame's last block is exactly the fill."""
    if img.mode not in ("L", "RGB"):
        return
    top, left, bottom, right = tail_box(height, width, reduction)
    tail = img.crop((left, top, right, bottom)).tobytes()
    if tail and not tail.strip(bytes([FILL])):
        raise TruncatedJpeg
