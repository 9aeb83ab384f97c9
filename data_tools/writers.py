"""What the builders share when they write: the error a build that cannot start raises, the files an
earlier build wrote (the only ones an ``--overwrite`` removes), clip_benchmark's offline ``wds`` layout,
and a built split's labelled samples in that layout. ``build`` (the command), ``demo`` (the packaged
demo sources), ``dense``, ``noto`` and ``negatives`` import it; it imports none of them."""

from __future__ import annotations

import json
from pathlib import Path

import webdataset as wds

from data_tools.parallel import STATS_DIR
from mmpretrain.data.manifest import MANIFEST, SIZES, read_sizes
from mmpretrain.data.tar import read_tar


class BuildError(RuntimeError):
    """Raised for a build that cannot start (bad arguments): exit code 2."""


def write_clip_benchmark_wds(root: Path, labelled: list[dict], classnames: list[str], templates: list[str]) -> None:
    """clip_benchmark's offline ``wds`` layout rooted at ``root``: ``classnames.txt``,
    ``zeroshot_classification_templates.txt``, ``test/nshards.txt``, ``test/{i}.tar`` with ``cls``."""
    (root / "test").mkdir(parents=True, exist_ok=True)
    (root / "classnames.txt").write_text("\n".join(classnames) + "\n", encoding="utf-8")
    (root / "zeroshot_classification_templates.txt").write_text("\n".join(templates) + "\n", encoding="utf-8")
    write_wds_split(root / "test", labelled)


def write_wds_split(folder: Path, samples: list[dict]) -> None:
    """One split of clip_benchmark's ``wds`` layout: ``folder/0.tar`` holding ``samples`` and ``nshards.txt``."""
    folder.mkdir(parents=True, exist_ok=True)
    with wds.TarWriter(str(folder / "0.tar"), encoder=False) as w:
        for s in samples:
            w.write(s)
    (folder / "nshards.txt").write_text("1\n")


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


def recorded_files(folder: Path) -> set[Path]:
    """The files an earlier build wrote into ``folder``: the shards its sizes.json and .build/ stats
    list, their .tmp parts, the stats, sizes.json and manifest.json. Nothing else is ever deleted."""
    names: set[str] = set()
    try:
        sizes = read_sizes(folder) if (folder / SIZES).is_file() else {}
    except ValueError:
        sizes = {}
    names |= {n for n in sizes if isinstance(n, str)} if isinstance(sizes, dict) else set()
    stats = sorted((folder / STATS_DIR).glob("*.json")) if (folder / STATS_DIR).is_dir() else []
    for p in stats:
        try:
            record = json.loads(p.read_text())
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("parts"), dict):
            names |= set(record["parts"]) | {p.name[: -len(".json")]}
    files = {folder / n for n in names} | {folder / (n + ".tmp") for n in names} | set(stats)
    files |= {folder / SIZES, folder / MANIFEST}
    return {f for f in files if f.is_file() and f.parent.resolve() in (folder.resolve(), (folder / STATS_DIR).resolve())}


def foreign_tars(folder: Path, ours: set[Path]) -> list[Path]:
    return sorted(p for p in folder.glob("*.tar") if p not in ours) if folder.is_dir() else []


def remove_files(files: set[Path]) -> None:
    for f in sorted(files):
        f.unlink(missing_ok=True)
    for d in {f.parent for f in files if f.parent.name == STATS_DIR}:
        if d.is_dir() and not any(d.iterdir()):
            d.rmdir()
