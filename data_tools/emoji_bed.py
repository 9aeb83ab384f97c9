"""``build demo:openmoji-all --out DIR [--second-style NOTO_DIR]``: the OpenMoji evidence bed
(:mod:`data_tools.sources.openmoji_all`) and, from Google's Noto emoji (npm ``emoji-datasource-google``),
the same held-out emoji in a second drawing style.

Layout::

    DIR/train/, DIR/test/           shards (caption 0 in .txt; extra captions, group, subgroup, base in .json)
    DIR/classnames.txt, DIR/test/   clip_benchmark's wds layout: zero-shot over the subgroups (held-out images)
    DIR/noto/                       the held-out emoji drawn by Noto, same classes and captions, same layout
    DIR/manifest.json               counts, what was left out and why, credits and licences
"""

from __future__ import annotations

import json
from pathlib import Path

from data_tools.images import encode, prepare
from data_tools.parallel import build_parallel
from data_tools.sources import openmoji_all
from data_tools.writers import BuildError, labelled_samples, write_clip_benchmark_wds
from mmpretrain.data.manifest import write_json_atomic

TEMPLATES = ("{c}", "a {c} emoji", "an emoji of a {c}", "an icon of a {c}", "a drawing of a {c}")
NOTO = "emoji-datasource-google"
NOTO_VERSION = "16.0.0"
NOTO_LICENSE = "Apache-2.0"
NOTO_ATTRIBUTION = ("Noto Emoji by Google (https://github.com/googlefonts/noto-emoji), Apache License 2.0; 64-px "
                    f"images from the npm package {NOTO}@{NOTO_VERSION} (https://github.com/iamcal/emoji-data)")
# what the second style's folder holds, removed by an --overwrite
NOTO_FILES = ("classnames.txt", "zeroshot_classification_templates.txt", "test/0.tar", "test/nshards.txt",
              "manifest.json")


def build_openmoji_all(out: Path, image_size: int, shard_size: int, limit: int | None, image_format: str,
                       workers: int = 1, second_style: str | None = None) -> dict:
    noto = _noto_index(Path(second_style)) if second_style else None  # refused before any work
    emoji, left_out = openmoji_all.list_emoji(limit)
    train, test, classes = openmoji_all.split(emoji)
    if len(classes) < 2:
        raise BuildError(f"--limit {limit} leaves {len(classes)} subgroups with 5 held-out images; raise or drop --limit")
    common = {
        "source": "demo:openmoji-all", "source_version": openmoji_all.version(), "license": "CC BY-SA 4.0",
        "attribution": " | ".join((openmoji_all.ATTRIBUTION, openmoji_all.UNICODE_CREDIT, openmoji_all.ALIAS_CREDIT)),
        "options": {"image_size": image_size, "shard_size": shard_size, "limit": limit, "image_format": image_format},
    }
    opts = {"image_size": image_size, "image_format": image_format, "quality": 95, "max_pixels": 64_000_000,
            "shard_bytes": 1e9}
    res = {}
    for split, items in (("train", train), ("test", test)):
        res[split] = build_parallel(openmoji_all.OpenmojiAllSplit(items, classes), out / split,
                                    prefix=f"openmoji-all-{split}", shard_size=shard_size, workers=workers, opts=opts,
                                    manifest=dict(common, split=split, classnames=classes,
                                                  extra_captions=sum(len(e.captions) for e in items)))
    labelled = labelled_samples(out / "test", image_format)
    write_clip_benchmark_wds(out, labelled, classes, list(TEMPLATES))
    per_class = [0] * len(classes)
    for s in labelled:
        per_class[int(s["cls"])] += 1
    summary = {
        "train": res["train"]["samples"], "test": res["test"]["samples"], "test_labelled": len(labelled),
        "classes": classes, "test_per_class": per_class,
        "base_emoji": {"train": len({e.base for e in train}), "test": len({e.base for e in test})},
        "extra_captions": sum(len(e.captions) for e in emoji),
        "left_out": left_out,
        "skipped": {"train": res["train"]["skipped"], "test": res["test"]["skipped"]},
    }
    if noto is not None:
        summary["second_style"] = build_second_style(out / "noto", test, classes, noto, image_size, image_format)
    write_json_atomic(out / "manifest.json", dict(common, splits=summary))
    return summary


def _noto_index(folder: Path) -> dict[str, Path]:
    """Code points without FE0F (lower-case hex) -> the 64-px PNG, from an unpacked
    ``emoji-datasource-google`` (its ``emoji.json`` and ``img/google/64/``)."""
    root = folder / "package" if (folder / "package" / "emoji.json").is_file() else folder
    index_file, images = root / "emoji.json", root / "img" / "google" / "64"
    if not index_file.is_file() or not images.is_dir():
        raise BuildError(f"--second-style {folder}: no emoji.json and img/google/64/ there; unpack npm's "
                         f"{NOTO}@{NOTO_VERSION} into it (`make noto` does)")
    try:
        entries = json.loads(index_file.read_text(encoding="utf-8"))
    except ValueError as e:
        raise BuildError(f"--second-style {index_file}: not JSON ({e})") from None
    out: dict[str, Path] = {}
    for entry in entries if isinstance(entries, list) else []:
        for v in [entry, *(entry.get("skin_variations") or {}).values()]:
            if isinstance(v, dict) and v.get("has_img_google") and v.get("unified") and v.get("image"):
                key = "-".join(c for c in v["unified"].lower().split("-") if c != "fe0f")
                out[key] = images / v["image"]
    if not out:
        raise BuildError(f"--second-style {index_file}: no entry with a Google image")
    return out


def build_second_style(root: Path, test: list, classes: list[str], noto: dict[str, Path], image_size: int,
                       image_format: str) -> dict:
    """The held-out emoji that Noto also draws (the two releases' overlap), in clip_benchmark's layout
    at ``root``: ``cls`` where the emoji is a zero-shot class member, every one with its caption (for
    retrieval). Returns the counts."""
    from PIL import Image

    from data_tools.images import BadImage

    samples, missing, unreadable = [], 0, 0
    for e in test:
        path = noto.get("-".join(c for c in e.key.split("-") if c != "fe0f"))
        if path is None:
            missing += 1
            continue
        try:
            with Image.open(path) as img:
                data = encode(prepare(img, image_size), image_format)
        except (OSError, BadImage):
            unreadable += 1
            continue
        sample = {"__key__": e.key, image_format: data, "txt": e.name.encode("utf-8")}
        if e.label is not None:
            sample["cls"] = str(e.label).encode()
        samples.append(sample)
    labelled = [s for s in samples if "cls" in s]
    write_clip_benchmark_wds(root, labelled, classes, list(TEMPLATES))
    counts = {"images": len(labelled), "unlabelled_not_written": len(samples) - len(labelled),
              "not_in_second_style": missing, "unreadable": unreadable,
              "per_class": [sum(int(s["cls"]) == i for s in labelled) for i in range(len(classes))]}
    write_json_atomic(root / "manifest.json", {"source": f"npm:{NOTO}@{NOTO_VERSION}", "license": NOTO_LICENSE,
                                               "attribution": NOTO_ATTRIBUTION, "of": "demo:openmoji-all test split",
                                               **counts})
    return counts
