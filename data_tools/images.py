"""Image normalisation for shards: RGB conversion, shorter-side resize, pixel cap, re-encoding."""

from __future__ import annotations

import io

from PIL import Image

# Pillow's own bomb check warns at ~89 Mpx; web data is capped far lower and the cap is a setting.
DEFAULT_MAX_PIXELS = 64_000_000


class BadImage(ValueError):
    """A sample whose image cannot be used; ``reason`` is the manifest's skip key."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def to_rgb(img: Image.Image) -> Image.Image:
    """RGB for any mode: palette and alpha are composited on white, CMYK and 16-bit converted."""
    if img.mode == "RGB":
        return img
    if img.mode in ("P", "PA"):
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "LA", "La", "RGBa"):
        img = img.convert("RGBA")
        bg = Image.new("RGB", img.size, (255, 255, 255))
        bg.paste(img, mask=img.getchannel("A"))
        return bg
    if img.mode in ("I;16", "I;16B", "I;16L", "I"):
        img = img.point(lambda v: v / 256).convert("L")
    return img.convert("RGB")


def resize_shorter(img: Image.Image, size: int) -> Image.Image:
    w, h = img.size
    short = min(w, h)
    if short <= size:
        return img
    scale = size / short
    return img.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.Resampling.LANCZOS)


def prepare(img: Image.Image, image_size: int, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    if img.width * img.height > max_pixels:
        raise BadImage("too_many_pixels", f"{img.width}x{img.height} > {max_pixels}")
    return resize_shorter(to_rgb(img), image_size)


def encode(img: Image.Image, fmt: str, quality: int = 95) -> bytes:
    buf = io.BytesIO()
    if fmt == "jpg":
        img.save(buf, format="JPEG", quality=quality)
    elif fmt == "png":
        img.save(buf, format="PNG", optimize=True)
    else:
        raise ValueError(f"image format {fmt!r}: use jpg or png")
    return buf.getvalue()
