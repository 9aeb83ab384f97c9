"""Per-pixel labelled sets from the packaged data, for ``python -m mmpretrain.eval --task dense_probe``:
``demo:mnist`` writes ``dense/`` beside its shards, each digit with a label map of its strokes (pixels at or
above half intensity are ``1 + digit``, the rest background ``0``); ``demo:openmoji`` each labelled emoji with
its glyph's alpha (``1 + class`` where the rendered alpha, resized with the image, is at least half, else
``0``). Both in clip_benchmark's ``wds`` layout with a ``train/`` and a ``test/`` split (the build's own) and
``classnames.txt`` (``background`` first).

A sample is ``{key}.png`` (the image) and ``{key}.seg.png`` (its label map: an 8-bit grey PNG of the same
size, one class index per pixel), plus ``{key}.cls`` (the image's class)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

from data_tools.writers import write_wds_split

DENSE = "dense"
# what a dense set writes under its root (check_demo_out removes exactly these on --overwrite)
DENSE_FILES = ("classnames.txt", "train/0.tar", "train/nshards.txt", "test/0.tar", "test/nshards.txt")
THRESHOLD = 128  # MNIST's strokes: pixels at or above half intensity


def label_map(mask: np.ndarray) -> bytes:
    """An 8-bit grey PNG of ``mask (H, W)`` class indices (0..255)."""
    if mask.min() < 0 or mask.max() > 255:
        raise ValueError("a label map holds class indices 0..255")
    buf = io.BytesIO()
    Image.fromarray(mask.astype(np.uint8), mode="L").save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def digit_mask(pixels: np.ndarray, digit: int) -> np.ndarray:
    """``1 + digit`` on the digit's strokes, 0 elsewhere."""
    return np.where(pixels >= THRESHOLD, 1 + digit, 0)


def write_dense(root: Path, splits: dict[str, list[dict]], classnames: list[str]) -> dict[str, int]:
    """``root/{train,test}/0.tar`` (+ ``nshards.txt``) from each split's samples and ``root/classnames.txt``;
    returns the samples per split."""
    for name, samples in splits.items():
        write_wds_split(root / name, samples)
    (root / "classnames.txt").write_text("\n".join(classnames) + "\n", encoding="utf-8")
    return {name: len(samples) for name, samples in splits.items()}


def mnist_dense(root: Path, splits: dict[str, list[int]]) -> dict[str, int]:
    """``demo:mnist``'s dense set: the digits of each split (their indices) with their stroke maps."""
    from data_tools.images import encode
    from data_tools.sources import mnist

    x, y = mnist.load()
    out = {name: [{"__key__": f"mnist{i:05d}", "png": encode(mnist.to_image(x[i]), "png"),
                   "seg.png": label_map(digit_mask(x[i], int(y[i]))), "cls": str(int(y[i])).encode()}
                  for i in idx] for name, idx in splits.items()}
    return write_dense(root, out, ["background", *mnist.CLASSNAMES])


def openmoji_dense(root: Path, splits: dict[str, list], classes: list[str], image_size: int) -> dict[str, int]:
    """``demo:openmoji``'s dense set: each split's labelled emoji drawn on white at ``image_size`` (the
    shards' resize) with the label map of its alpha."""
    from data_tools.images import encode, resize_shorter
    from data_tools.sources.openmoji import Renderer

    render = Renderer()
    out: dict[str, list[dict]] = {}
    for name, items in splits.items():
        rows = []
        for e in items:
            if e.label not in classes:
                continue
            rgba = resize_shorter(render.rgba(e.text), image_size)
            white = Image.new("RGB", rgba.size, (255, 255, 255))
            white.paste(rgba, mask=rgba.getchannel("A"))
            c = classes.index(e.label)
            mask = np.where(np.array(rgba.getchannel("A")) >= THRESHOLD, 1 + c, 0)
            rows.append({"__key__": e.key, "png": encode(white, "png"), "seg.png": label_map(mask),
                         "cls": str(c).encode()})
        out[name] = rows
    return write_dense(root, out, ["background", *classes])
