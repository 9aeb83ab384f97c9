"""What the builders share when they write: the error a build that cannot start raises, clip_benchmark's
offline ``wds`` layout, and a built split's labelled samples in that layout. ``build`` (the command and
the packaged demo sources) and ``emoji_bed`` (``demo:openmoji-all``) both import it; neither imports the
other's writers."""

from __future__ import annotations

import json
from pathlib import Path

import webdataset as wds

from mmpretrain.data.manifest import read_sizes
from mmpretrain.data.tar import read_tar


class BuildError(RuntimeError):
    """Raised for a build that cannot start (bad arguments): exit code 2."""


def write_clip_benchmark_wds(root: Path, labelled: list[dict], classnames: list[str], templates: list[str]) -> None:
    """clip_benchmark's offline ``wds`` layout rooted at ``root``: ``classnames.txt``,
    ``zeroshot_classification_templates.txt``, ``test/nshards.txt``, ``test/{i}.tar`` with ``cls``."""
    (root / "test").mkdir(parents=True, exist_ok=True)
    (root / "classnames.txt").write_text("\n".join(classnames) + "\n", encoding="utf-8")
    (root / "zeroshot_classification_templates.txt").write_text("\n".join(templates) + "\n", encoding="utf-8")
    with wds.TarWriter(str(root / "test" / "0.tar"), encoder=False) as w:
        for s in labelled:
            w.write(s)
    (root / "test" / "nshards.txt").write_text("1\n")


def labelled_samples(folder: Path, image_format: str) -> list[dict]:
    """The labelled samples of a built split, as clip_benchmark's ``wds`` samples (``cls``)."""
    labelled = []
    for shard in sorted(read_sizes(folder)):
        for s in read_tar(folder / shard):
            meta = json.loads(s["json"])
            if "label" in meta:
                labelled.append({"__key__": s["__key__"], image_format: s[image_format], "txt": s["txt"],
                                 "cls": str(meta["label"]).encode()})
    return labelled
