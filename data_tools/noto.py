"""``demo:openmoji-all``'s second drawing style: its held-out emoji as Google's Noto emoji draws them
(npm ``emoji-datasource-google``), in clip_benchmark's layout under ``DIR/noto/`` (``--second-style``)."""

from __future__ import annotations

import json
from pathlib import Path

from data_tools.images import encode, prepare
from data_tools.writers import BuildError, write_clip_benchmark_wds
from mmpretrain.data.manifest import write_json_atomic

NOTO = "emoji-datasource-google"
NOTO_VERSION = "16.0.0"
NOTO_LICENSE = "Apache-2.0"
NOTO_ATTRIBUTION = ("Noto Emoji by Google (https://github.com/googlefonts/noto-emoji), Apache License 2.0; 64-px "
                    f"images from the npm package {NOTO}@{NOTO_VERSION} (https://github.com/iamcal/emoji-data)")
# what the second style's folder holds (under DIR/noto/), removed by an --overwrite
NOTO_FILES = ("classnames.txt", "zeroshot_classification_templates.txt", "test/0.tar", "test/nshards.txt",
              "manifest.json")


def noto_index(folder: Path) -> dict[str, Path]:
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
                       image_format: str, templates: list[str]) -> dict:
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
    write_clip_benchmark_wds(root, labelled, classes, templates)
    counts = {"images": len(labelled), "unlabelled_not_written": len(samples) - len(labelled),
              "not_in_second_style": missing, "unreadable": unreadable,
              "per_class": [sum(int(s["cls"]) == i for s in labelled) for i in range(len(classes))]}
    write_json_atomic(root / "manifest.json", {"source": f"npm:{NOTO}@{NOTO_VERSION}", "license": NOTO_LICENSE,
                                               "attribution": NOTO_ATTRIBUTION, "of": "demo:openmoji-all test split",
                                               **counts})
    return counts
