"""``build SOURCE --out DIR``: shards from a source, with a held-out split where the source has one."""

from __future__ import annotations

import json
from pathlib import Path

from data_tools.emoji_bed import build_openmoji_all
from data_tools.writers import BuildError, labelled_samples, write_clip_benchmark_wds
from mmpretrain.data.manifest import MANIFEST, SIZES, read_sizes, write_json_atomic

__all__ = ["BuildError", "build", "check_source_and_out", "recorded_files", "write_clip_benchmark_wds"]

DEMO_SOURCES = ("demo:openmoji", "demo:openmoji-all", "demo:mnist")


WDS_FILES = ("classnames.txt", "zeroshot_classification_templates.txt")


def check_source_and_out(source: str, out: Path) -> None:
    """``build`` reads SOURCE and writes --out: an --out equal to, inside or above the source is refused
    (an --overwrite there would delete the input before reading it)."""
    if source.startswith(("hf:", "demo:")) and not Path(source).exists():
        return
    src, o = Path(source).resolve(), out.resolve()
    where = "is" if o == src else "is inside" if src in o.parents else "contains" if o in src.parents else None
    if where:
        raise BuildError(f"--out {out} {where} the source {source}: build writes beside nothing it reads. "
                         "Choose an --out outside the source")


def recorded_files(folder: Path) -> set[Path]:
    """The files an earlier build wrote into ``folder``: the shards its sizes.json and .build/ stats
    list, their .tmp parts, the stats, sizes.json and manifest.json. Nothing else is ever deleted."""
    from data_tools.parallel import STATS_DIR

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


def _foreign_tars(folder: Path, ours: set[Path]) -> list[Path]:
    return sorted(p for p in folder.glob("*.tar") if p not in ours) if folder.is_dir() else []


def _remove(files: set[Path]) -> None:
    from data_tools.parallel import STATS_DIR

    for f in sorted(files):
        f.unlink(missing_ok=True)
    for d in {f.parent for f in files if f.parent.name == STATS_DIR}:
        if d.is_dir() and not any(d.iterdir()):
            d.rmdir()


def _check_out(out: Path, overwrite: bool) -> None:
    """The demo's layout (train/, test/, clip_benchmark's wds files): rebuilt only with --overwrite, and
    then only the files an earlier build wrote are removed."""
    existing = [p for p in (out / "train" / SIZES, out / "test" / SIZES, out / SIZES) if p.exists()]
    if existing and not overwrite:
        raise BuildError(f"{out} already holds a dataset ({existing[0]}); pass --overwrite to rebuild it")
    ours: set[Path] = set()
    for sub in ("train", "test"):
        ours |= recorded_files(out / sub)
    nshards = out / "test" / "nshards.txt"
    if nshards.is_file():
        try:
            ours |= {out / "test" / f"{i}.tar" for i in range(int(nshards.read_text().strip()))} | {nshards}
        except ValueError:
            pass
    ours |= {out / f for f in (*WDS_FILES, MANIFEST, SIZES)}
    # demo:mnist's out-of-domain set (scikit-learn's digits), in its own clip_benchmark root
    ours |= {out / "digits" / f for f in WDS_FILES} | {out / "digits/test" / f for f in ("0.tar", "nshards.txt")}
    # demo:openmoji-all's second drawing style (data_tools/emoji_bed.py), also a clip_benchmark root
    ours |= {out / "noto" / f for f in (*WDS_FILES, "test/0.tar", "test/nshards.txt", MANIFEST)}
    ours = {f for f in ours if f.is_file()}
    foreign = [t for sub in ("train", "test") for t in _foreign_tars(out / sub, ours)]
    if foreign:
        raise BuildError(f"{out} holds {foreign[0]} ({len(foreign)} tar file(s)) that no build wrote: the demo's "
                         "shards would mix with them. Choose another --out")
    if existing:
        _remove(ours)


def _claim_out(out: Path, manifest: dict, overwrite: bool) -> None:
    """Resume only a build of the same source with the same options; anything else needs --overwrite,
    which removes only the files the earlier build wrote. Tar files no build wrote are refused."""
    from data_tools.parallel import STATS_DIR

    marker = out / STATS_DIR / "build.json"
    ours = recorded_files(out)
    foreign = _foreign_tars(out, ours)
    if foreign:
        raise BuildError(f"--out {out} holds {foreign[0]} ({len(foreign)} tar file(s)) that no build wrote: the "
                         "new shards would mix with (or replace) them. Choose an empty folder")
    existing = (out / SIZES).is_file() or marker.is_file() or bool(ours)
    if existing and overwrite:
        _remove(ours | ({marker} if marker.is_file() else set()))
    elif existing:
        previous = json.loads(marker.read_text()) if marker.is_file() else None
        if previous != {"source": manifest["source"], "options": manifest["options"]}:
            raise BuildError(f"{out} already holds a dataset that is not this build (another source or other "
                             "options); pass --overwrite to rebuild it, or choose another --out")
    write_json_atomic(marker, {"source": manifest["source"], "options": manifest["options"]})


def build_mnist(out: Path, image_size: int, shard_size: int, limit: int | None, image_format: str,
                workers: int = 1) -> dict:
    """``demo:mnist`` (data_tools/sources/mnist.py): ``train/`` (4,000 captioned digits), ``test/``
    (1,000 held out, 100 per class) with clip_benchmark's layout at ``out``, and ``digits/``:
    scikit-learn's 1,797 8x8 digits, an out-of-domain zero-shot set in the same layout."""
    from data_tools.images import encode, prepare
    from data_tools.parallel import build_parallel
    from data_tools.sources import mnist

    _, labels = mnist.load()
    train, test = mnist.split(labels)
    if limit:
        train, test = train[:limit], test[: max(10, limit // 4)]
    common = {"source": "demo:mnist", "source_version": mnist.version(), "license": mnist.LICENSE,
              "attribution": mnist.ATTRIBUTION,
              "options": {"image_size": image_size, "shard_size": shard_size, "limit": limit, "image_format": image_format}}
    opts = {"image_size": image_size, "image_format": image_format, "quality": 95, "max_pixels": 64_000_000,
            "shard_bytes": 1e9}
    res = {}
    for split, items in (("train", train), ("test", test)):
        res[split] = build_parallel(mnist.MnistSplit(items), out / split, prefix=f"mnist-{split}", shard_size=shard_size,
                                    workers=workers, opts=opts,
                                    manifest=dict(common, split=split, classnames=mnist.CLASSNAMES))
    labelled = labelled_samples(out / "test", image_format)
    write_clip_benchmark_wds(out, labelled, mnist.CLASSNAMES, list(mnist.TEMPLATES))
    images, targets = mnist.load_digits_images()
    digits = []
    for i, (img, t) in enumerate(zip(images, targets)):
        digits.append({"__key__": f"digits{i:05d}", image_format: encode(prepare(img, image_size), image_format),
                       "cls": str(t).encode()})
    write_clip_benchmark_wds(out / "digits", digits, mnist.CLASSNAMES, list(mnist.TEMPLATES))
    summary = {"train": res["train"]["samples"], "test": res["test"]["samples"], "test_labelled": len(labelled),
               "digits": len(digits), "classes": mnist.CLASSNAMES,
               "skipped": {"train": res["train"]["skipped"], "test": res["test"]["skipped"]}}
    write_json_atomic(out / "manifest.json", dict(common, splits=summary))
    return summary


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
    labelled = labelled_samples(out / "test", image_format)
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
          quality: int = 95, max_pixels: int = 64_000_000, second_style: str | None = None,
          extra_captions_column: str | None = None, negative_captions_column: str | None = None) -> dict:
    """Build ``out`` from ``source``. Demo sources write ``out/train`` and ``out/test``; other sources
    write one dataset folder ``out``. Re-running an interrupted build of the same source resumes it."""
    from data_tools.parallel import build_parallel
    from data_tools.sources.files import open_source
    from data_tools.sources.records import SourceError

    out = Path(out)
    check_source_and_out(source, out)
    if source.startswith("demo:") or source_type == "demo":
        if source not in DEMO_SOURCES:
            raise BuildError(f"unknown demo source {source!r}; packaged ones: {', '.join(DEMO_SOURCES)}")
        if second_style and source != "demo:openmoji-all":
            raise BuildError(f"--second-style is for demo:openmoji-all (the Noto images of its held-out emoji), not {source}")
        _check_out(out, overwrite)
        if source == "demo:openmoji-all":
            return build_openmoji_all(out, image_size, shard_size, limit, image_format or "png", workers, second_style)
        demo = build_mnist if source == "demo:mnist" else build_openmoji
        return demo(out, image_size, shard_size, limit, image_format or "png", workers)
    try:
        src = open_source(source, source_type, image_column=image_column, caption_column=caption_column,
                          base_dir=base_dir, key_column=key_column, captions=captions,
                          extra_column=extra_captions_column, negative_column=negative_captions_column)
    except SourceError as e:
        raise BuildError(str(e)) from None
    if limit is not None and hasattr(src, "files"):
        src.files = src.files[:limit]
    opts = {"image_size": image_size, "image_format": image_format or "jpg", "quality": quality,
            "max_pixels": max_pixels, "shard_bytes": shard_bytes}
    manifest = {"source": str(source), "source_kind": src.kind,
                "options": dict(opts, shard_size=shard_size, image_column=image_column,
                                caption_column=caption_column, key_column=key_column, base_dir=base_dir,
                                limit=limit, **({"extra_captions_column": extra_captions_column}
                                                if extra_captions_column else {}),
                                **({"negative_captions_column": negative_captions_column}
                                   if negative_captions_column else {}))}
    _claim_out(out, manifest, overwrite)
    return build_parallel(src, out, prefix=out.resolve().name or "shard", shard_size=shard_size,
                          workers=workers, opts=opts, manifest=manifest)


