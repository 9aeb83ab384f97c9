"""``build SOURCE --out DIR``: shards from a source, with a held-out split where the source has one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import webdataset as wds

from mmpretrain.data.manifest import SIZES, read_sizes, write_json_atomic
from mmpretrain.data.tar import read_tar

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


def _claim_out(out: Path, manifest: dict, overwrite: bool) -> None:
    """Resume only a build of the same source with the same options; anything else needs --overwrite."""
    from data_tools.parallel import STATS_DIR

    marker = out / STATS_DIR / "build.json"
    existing = (out / SIZES).is_file() or any(out.glob("*.tar")) or marker.is_file()
    if existing and overwrite:
        shutil.rmtree(out / STATS_DIR, ignore_errors=True)
        for p in list(out.glob("*.tar")) + list(out.glob("*.tar.tmp")):
            p.unlink()
        for f in (SIZES, "manifest.json"):
            (out / f).unlink(missing_ok=True)
    elif existing:
        previous = json.loads(marker.read_text()) if marker.is_file() else None
        if previous != {"source": manifest["source"], "options": manifest["options"]}:
            raise BuildError(f"{out} already holds a dataset that is not this build (another source or other "
                             "options); pass --overwrite to rebuild it, or choose another --out")
    write_json_atomic(marker, {"source": manifest["source"], "options": manifest["options"]})


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


def build_openmoji(out: Path, image_size: int, shard_size: int, limit: int | None, image_format: str,
                   workers: int = 1) -> dict:
    from data_tools.parallel import build_parallel
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
    opts = {"image_size": image_size, "image_format": image_format, "quality": 95,
            "max_pixels": 64_000_000, "shard_bytes": 1e9}
    res = {}
    for split, items, extra in (("train", train, {}), ("test", test, {"classnames": classes})):
        res[split] = build_parallel(openmoji.OpenmojiSplit(items, classes), out / split,
                                    prefix=f"openmoji-{split}", shard_size=shard_size, workers=workers, opts=opts,
                                    manifest=dict(common, split=split, **extra))
    # The labelled held-out samples, again in clip_benchmark's layout (DIR is its dataset root).
    labelled = []
    for shard in sorted(read_sizes(out / "test")):
        for s in read_tar(out / "test" / shard):
            meta = json.loads(s["json"])
            if "label" in meta:
                labelled.append(
                    {"__key__": s["__key__"], image_format: s[image_format], "txt": s["txt"],
                     "cls": str(meta["label"]).encode()}
                )
    write_clip_benchmark_wds(out, labelled, classes, list(openmoji.TEMPLATES))
    summary = {
        "train": res["train"]["samples"],
        "test": res["test"]["samples"],
        "test_labelled": len(labelled),
        "classes": classes,
        "skipped": {"train": res["train"]["skipped"], "test": res["test"]["skipped"]},
    }
    write_json_atomic(out / "manifest.json", dict(common, splits=summary))
    return summary


def build(source: str, out: str | Path, *, image_size: int, shard_size: int, limit: int | None = None,
          image_format: str | None = None, overwrite: bool = False, source_type: str | None = None,
          image_column: str | None = None, caption_column: str | None = None, key_column: str | None = None,
          base_dir: str | None = None, captions: str | None = None, workers: int = 1, shard_bytes: float = 1e9,
          quality: int = 95, max_pixels: int = 64_000_000) -> dict:
    """Build ``out`` from ``source``. Demo sources write ``out/train`` and ``out/test``; other sources
    write one dataset folder ``out``. Re-running an interrupted build of the same source resumes it."""
    from data_tools.parallel import build_parallel
    from data_tools.sources.files import SourceError, open_source

    out = Path(out)
    if source.startswith("demo:") or source_type == "demo":
        if source not in DEMO_SOURCES:
            raise BuildError(f"unknown demo source {source!r}; packaged ones: {', '.join(DEMO_SOURCES)}")
        _check_out(out, overwrite)
        return build_openmoji(out, image_size, shard_size, limit, image_format or "png", workers)
    try:
        src = open_source(source, source_type, image_column=image_column, caption_column=caption_column,
                          base_dir=base_dir, key_column=key_column, captions=captions)
    except SourceError as e:
        raise BuildError(str(e)) from None
    if limit is not None and hasattr(src, "files"):
        src.files = src.files[:limit]
    opts = {"image_size": image_size, "image_format": image_format or "jpg", "quality": quality,
            "max_pixels": max_pixels, "shard_bytes": shard_bytes}
    manifest = {"source": str(source), "source_kind": src.kind,
                "options": dict(opts, shard_size=shard_size, image_column=image_column,
                                caption_column=caption_column, key_column=key_column, base_dir=base_dir,
                                limit=limit)}
    _claim_out(out, manifest, overwrite)
    return build_parallel(src, out, prefix=out.resolve().name or "shard", shard_size=shard_size,
                          workers=workers, opts=opts, manifest=manifest)


