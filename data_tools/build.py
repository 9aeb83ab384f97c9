"""``build SOURCE --out DIR``: shards from a source, with a held-out split where the source has one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import webdataset as wds

from data_tools.writer import write_split
from mmpretrain.data.manifest import SIZES, write_json_atomic
from mmpretrain.data.shards import iter_samples

DEMO_SOURCES = ("demo:openmoji",)


class BuildError(RuntimeError):
    """Raised for a build that cannot start (bad arguments): exit code 2."""


def _check_out(out: Path, overwrite: bool) -> None:
    existing = [p for p in (out / "train" / SIZES, out / "test" / SIZES, out / SIZES) if p.exists()]
    if existing and not overwrite:
        raise BuildError(f"{out} already holds a dataset ({existing[0]}); pass --overwrite to rebuild it")
    if existing and overwrite:
        for sub in ("train", "test"):
            shutil.rmtree(out / sub, ignore_errors=True)
        for f in ("classnames.txt", "zeroshot_classification_templates.txt", "manifest.json", SIZES):
            (out / f).unlink(missing_ok=True)


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


def build_openmoji(out: Path, image_size: int, shard_size: int, limit: int | None, image_format: str) -> dict:
    from data_tools.sources import openmoji

    emoji = openmoji.list_emoji(limit)
    train, test, classes = openmoji.split(emoji)
    if len(classes) < 2:
        raise BuildError(f"--limit {limit} leaves {len(classes)} keyword classes; raise or drop --limit")
    common = {
        "source": "demo:openmoji",
        "source_version": openmoji.version(),
        "license": "CC BY-SA 4.0",
        "attribution": openmoji.ATTRIBUTION,
        "options": {"image_size": image_size, "shard_size": shard_size, "limit": limit, "image_format": image_format},
    }
    kw = dict(image_size=image_size, image_format=image_format, shard_size=shard_size)
    res_train = write_split(
        openmoji.samples(train, classes), out / "train", prefix="openmoji-train", manifest=dict(common, split="train"), **kw
    )
    res_test = write_split(
        openmoji.samples(test, classes),
        out / "test",
        prefix="openmoji-test",
        manifest=dict(common, split="test", classnames=classes),
        **kw,
    )
    # The labelled held-out samples, again in clip_benchmark's layout (DIR is its dataset root).
    labelled = []
    for shard in sorted(res_test.sizes):
        for s in iter_samples(out / "test" / shard):
            meta = json.loads(s["json"])
            if "label" in meta:
                labelled.append(
                    {"__key__": s["__key__"], image_format: s[image_format], "txt": s["txt"],
                     "cls": str(meta["label"]).encode()}
                )
    write_clip_benchmark_wds(out, labelled, classes, list(openmoji.TEMPLATES))
    summary = {
        "train": res_train.count,
        "test": res_test.count,
        "test_labelled": len(labelled),
        "classes": classes,
        "skipped": {"train": dict(res_train.skipped), "test": dict(res_test.skipped)},
    }
    write_json_atomic(out / "manifest.json", dict(common, splits=summary))
    return summary


def build(source: str, out: str | Path, *, image_size: int, shard_size: int, limit: int | None,
          image_format: str | None, overwrite: bool) -> dict:
    out = Path(out)
    _check_out(out, overwrite)
    if source == "demo:openmoji":
        return build_openmoji(out, image_size, shard_size, limit, image_format or "png")
    raise BuildError(
        f"source {source!r} is not supported yet; supported sources: {', '.join(DEMO_SOURCES)}"
    )


