"""Photo-like JPEGs for the loader's tests and benchmarks: the colour photos scikit-image and scikit-learn
ship (read from their package files, nothing fetched), each JPEG a different random crop (area 30-100 %,
aspect 1:1, 4:3, 3:2, 2:1 or portrait), flip and scale (shorter side 256-512 px), quality 90, as
img2dataset writes web images; and JPEGs damaged as downloads and tools damage them (cut short but ending
in EOI, a lying frame header, broken Huffman tables). scikit-image is a dev dependency."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

from mmpretrain.data.jpeg import read_frame

ASPECTS = (1.0, 4 / 3, 3 / 2, 2.0, 3 / 4, 2 / 3)


def photos() -> list[tuple[str, np.ndarray]]:
    """The colour photos the two packages ship, read from their files (nothing is fetched)."""
    import skimage.data
    from sklearn.datasets import load_sample_images

    here = Path(skimage.data.__file__).parent
    files = {"astronaut": "astronaut.png", "cat": "chelsea.png", "coffee": "coffee.png", "rocket": "rocket.jpg",
             "motorcycle": "motorcycle_left.png", "retina": "retina.jpg", "galaxies": "hubble_deep_field.jpg",
             "tissue": "ihc.png"}
    out = [(n, np.asarray(Image.open(here / f).convert("RGB"))) for n, f in files.items()]
    return out + list(zip(("china", "flower"), load_sample_images().images))


def make_jpegs(n: int, seed: int = 0, short_side: tuple[int, int] = (256, 512)) -> list[tuple[str, bytes]]:
    """``n`` distinct photo JPEGs with captions, shorter side uniform in ``short_side`` (inclusive)."""
    rng = np.random.default_rng(seed)
    src = photos()
    out = []
    for i in range(n):
        name, arr = src[i % len(src)]
        img = Image.fromarray(arr)
        w, h = img.size
        aspect = ASPECTS[rng.integers(len(ASPECTS))]
        area = rng.uniform(0.3, 1.0) * w * h
        cw, ch = min(w, int(round((area * aspect) ** 0.5))), min(h, int(round((area / aspect) ** 0.5)))
        x, y = rng.integers(0, w - cw + 1), rng.integers(0, h - ch + 1)
        img = img.crop((x, y, x + cw, y + ch))
        if rng.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        short = rng.integers(short_side[0], short_side[1] + 1)
        s = short / min(img.size)
        img = img.resize((max(1, round(img.width * s)), max(1, round(img.height * s))), Image.BICUBIC)
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=90)
        out.append((f"a photo of {name.replace('_', ' ')}, view {i}", buf.getvalue()))
    return out


def write_shards(samples: list[tuple[str, bytes]], folder: Path, per_shard: int = 100) -> None:
    """``(caption, jpg)`` samples as WebDataset shards of ``per_shard`` with a ``sizes.json``, in a new
    ``folder`` (webdataset's writer)."""
    import json

    import webdataset as wds

    folder.mkdir(parents=True)
    sizes = {}
    for s in range(0, len(samples), per_shard):
        name = f"photo-{s // per_shard:06d}.tar"
        with wds.TarWriter(str(folder / name)) as w:
            for i, (caption, jpg) in enumerate(samples[s:s + per_shard], s):
                w.write({"__key__": f"{i:08d}", "jpg": jpg, "txt": caption})
        sizes[name] = len(samples[s:s + per_shard])
    (folder / "sizes.json").write_text(json.dumps(sizes))


# ------------------------------------------------------------------ damaged JPEGs (tests, the GPU check)


def cut_short(jpg: bytes, keep: float = 0.5) -> bytes:
    """``jpg`` with its entropy-coded data cut to ``keep`` and an EOI marker after, as long as before (the
    bytes cut ride in COM segments after SOI, so a shard patched in place keeps its size)."""
    start = read_frame(jpg).scan_start
    cut = start + int((len(jpg) - start) * keep)
    while 0 < len(jpg) - cut - 2 < 4:  # a COM segment takes at least 4 bytes
        cut -= 1
    body = jpg[:cut] + b"\xff\xd9"
    pad, coms = len(jpg) - len(body), b""
    while pad:
        n = min(pad, 65537) - (4 if 0 < pad - min(pad, 65537) < 4 else 0)
        coms += b"\xff\xfe" + (n - 2).to_bytes(2, "big") + b"\0" * (n - 4)
        pad -= n
    return body[:2] + coms + body[2:]


def lying(jpg: bytes, size: int = 8000) -> bytes:
    """``jpg`` with its frame header claiming ``size`` x ``size`` (same length)."""
    sof = next(jpg.index(m) for m in (b"\xff\xc0", b"\xff\xc2") if m in jpg)
    return jpg[:sof + 5] + size.to_bytes(2, "big") * 2 + jpg[sof + 9:]


def bad_huffman(jpg: bytes) -> bytes:
    """The same JPEG, same length, with its first Huffman table's code counts overwritten: the header
    still reads as a baseline JPEG, but neither libjpeg (Pillow, torchvision) nor nvJPEG can decode it."""
    j = jpg.index(b"\xff\xc4")
    return jpg[:j + 5] + b"\xff" * 16 + jpg[j + 21:]
