"""The packaged demo sources (``build demo:NAME --out DIR``), each a train split, a held-out test split and
the test split's labelled samples in clip_benchmark's offline layout at ``DIR``, built on one skeleton
(:func:`build_splits`): ``demo:openmoji`` (data_tools/sources/openmoji.py), ``demo:mnist`` (with
scikit-learn's digits as an out-of-domain set in ``DIR/digits/``) and ``demo:openmoji-all``, the evidence
bed (with its held-out emoji in Noto's style in ``DIR/noto/``, data_tools/noto.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from data_tools.dense import DENSE, DENSE_FILES, mnist_dense, openmoji_dense
from data_tools.images import encode, prepare
from data_tools.noto import NOTO_FILES, build_second_style, noto_index
from data_tools.parallel import build_parallel
from data_tools.writers import (
    BuildError,
    foreign_tars,
    labelled_samples,
    recorded_files,
    remove_files,
    write_clip_benchmark_wds,
)
from mmpretrain.data.manifest import MANIFEST, SIZES, write_json_atomic

DEMO_SOURCES = ("demo:openmoji", "demo:openmoji-all", "demo:mnist")
WDS_FILES = ("classnames.txt", "zeroshot_classification_templates.txt")


def build_demo(source: str, out: Path, *, image_size: int, shard_size: int, limit: int | None, image_format: str,
               workers: int, overwrite: bool, second_style: str | None) -> dict:
    """Build the demo source ``source`` into ``out`` (its layout refused or rebuilt by :func:`check_demo_out`)."""
    if source not in DEMO_SOURCES:
        raise BuildError(f"unknown demo source {source!r}; packaged ones: {', '.join(DEMO_SOURCES)}")
    if second_style and source != "demo:openmoji-all":
        raise BuildError(f"--second-style is for demo:openmoji-all (the Noto images of its held-out emoji), not {source}")
    noto = noto_index(Path(second_style)) if second_style else None  # refused before any work
    check_demo_out(out, overwrite)
    args = (out, image_size, shard_size, limit, image_format, workers)
    if source == "demo:openmoji-all":
        return build_openmoji_all(*args, noto=noto)
    return (build_mnist if source == "demo:mnist" else build_openmoji)(*args)


def build_splits(out: Path, source: str, version: str, license: str, attribution: str, prefix: str,
                 splits: dict[str, tuple[Any, dict]], classes: list[str], templates: list[str], image_size: int,
                 shard_size: int, limit: int | None, image_format: str, workers: int) -> tuple[dict, dict, list[dict]]:
    """The skeleton every demo source shares: each of ``splits`` (``name -> (records, manifest extras)``)
    written as shards under ``out/name``, the test split's labelled samples in clip_benchmark's layout at
    ``out``. Returns ``(common manifest fields, summary, labelled samples)``; the caller adds its own
    summary entries and writes ``out/manifest.json`` with :func:`write_manifest`."""
    options = {"image_size": image_size, "shard_size": shard_size, "limit": limit, "image_format": image_format}
    common = {"source": source, "source_version": version, "license": license, "attribution": attribution,
              "options": options}
    opts = {"image_size": image_size, "image_format": image_format, "quality": 95, "max_pixels": 64_000_000,
            "shard_bytes": 1e9}
    res = {split: build_parallel(records, out / split, prefix=f"{prefix}-{split}", shard_size=shard_size,
                                 workers=workers, opts=opts, manifest=dict(common, split=split, **extra))
           for split, (records, extra) in splits.items()}
    labelled = labelled_samples(out / "test", image_format)
    write_clip_benchmark_wds(out, labelled, classes, templates)
    summary = {"train": res["train"]["samples"], "test": res["test"]["samples"], "test_labelled": len(labelled),
               "classes": classes, "skipped": {"train": res["train"]["skipped"], "test": res["test"]["skipped"]}}
    return common, summary, labelled


def write_manifest(out: Path, common: dict, summary: dict, **extra: Any) -> dict:
    """``out/manifest.json``: the common fields and the summary with the source's own entries (the skipped
    counts last); returns the summary."""
    skipped = summary.pop("skipped")
    summary = {**summary, **extra, "skipped": skipped}
    write_json_atomic(out / MANIFEST, dict(common, splits=summary))
    return summary


def build_openmoji(out: Path, image_size: int, shard_size: int, limit: int | None, image_format: str,
                   workers: int = 1) -> dict:
    from data_tools.sources import openmoji

    train, test, classes = openmoji.split(openmoji.list_emoji(limit))
    if len(classes) < 2:
        raise BuildError(f"--limit {limit} leaves {len(classes)} keyword classes; raise or drop --limit")
    splits = {"train": (openmoji.OpenmojiSplit(train, classes), {}),
              "test": (openmoji.OpenmojiSplit(test, classes), {"classnames": classes})}
    common, summary, _ = build_splits(out, "demo:openmoji", openmoji.version(), "CC BY-SA 4.0", openmoji.ATTRIBUTION,
                                      "openmoji", splits, classes, list(openmoji.TEMPLATES), image_size, shard_size,
                                      limit, image_format, workers)
    dense = openmoji_dense(out / DENSE, {"train": train, "test": test}, classes, image_size)  # alpha label maps
    return write_manifest(out, common, summary, dense=dense)


def build_mnist(out: Path, image_size: int, shard_size: int, limit: int | None, image_format: str,
                workers: int = 1) -> dict:
    """``demo:mnist`` (data_tools/sources/mnist.py): ``train/`` (4,000 captioned digits), ``test/``
    (1,000 held out, 100 per class) with clip_benchmark's layout at ``out``, ``digits/``: scikit-learn's
    1,797 8x8 digits, an out-of-domain zero-shot set in the same layout, and ``dense/``: the same digits with
    their strokes' label maps, for the dense probe (data_tools/dense.py)."""
    from data_tools.sources import mnist

    _, labels = mnist.load()
    train, test = mnist.split(labels)
    if limit:
        train, test = train[:limit], test[: max(10, limit // 4)]
    classes, extra = mnist.CLASSNAMES, {"classnames": mnist.CLASSNAMES}
    splits = {"train": (mnist.MnistSplit(train), extra), "test": (mnist.MnistSplit(test), extra)}
    common, summary, _ = build_splits(out, "demo:mnist", mnist.version(), mnist.LICENSE, mnist.ATTRIBUTION, "mnist",
                                      splits, classes, list(mnist.TEMPLATES), image_size, shard_size, limit,
                                      image_format, workers)
    images, targets = mnist.load_digits_images()
    digits = [{"__key__": f"digits{i:05d}", image_format: encode(prepare(img, image_size), image_format),
               "cls": str(t).encode()} for i, (img, t) in enumerate(zip(images, targets))]
    write_clip_benchmark_wds(out / "digits", digits, classes, list(mnist.TEMPLATES))
    dense = mnist_dense(out / DENSE, {"train": train, "test": test})  # the dense probe's per-pixel labels
    return write_manifest(out, common, summary, digits=len(digits), dense=dense)


def build_openmoji_all(out: Path, image_size: int, shard_size: int, limit: int | None, image_format: str,
                       workers: int = 1, noto: dict[str, Path] | None = None) -> dict:
    """``demo:openmoji-all`` (data_tools/sources/openmoji_all.py); ``noto``: the second style's images
    (:func:`data_tools.noto.noto_index`), written to ``out/noto/``."""
    from data_tools.sources import openmoji_all as src

    emoji, left_out = src.list_emoji(limit)
    train, test, classes = src.split(emoji)
    if len(classes) < 2:
        raise BuildError(f"--limit {limit} leaves {len(classes)} subgroups with 5 held-out images; raise or drop --limit")
    splits = {name: (src.OpenmojiAllSplit(items, classes),
                     {"classnames": classes, "extra_captions": sum(len(e.captions) for e in items)})
              for name, items in (("train", train), ("test", test))}
    attribution = " | ".join((src.ATTRIBUTION, src.UNICODE_CREDIT, src.ALIAS_CREDIT))
    common, summary, labelled = build_splits(out, "demo:openmoji-all", src.version(), "CC BY-SA 4.0", attribution,
                                             "openmoji-all", splits, classes, list(src.TEMPLATES), image_size,
                                             shard_size, limit, image_format, workers)
    per_class = [0] * len(classes)
    for s in labelled:
        per_class[int(s["cls"])] += 1
    extra = {"test_per_class": per_class, "base_emoji": {"train": len({e.base for e in train}),
                                                         "test": len({e.base for e in test})},
             "extra_captions": sum(len(e.captions) for e in emoji), "left_out": left_out}
    if noto is not None:
        extra["second_style"] = build_second_style(out / "noto", test, classes, noto, image_size, image_format,
                                                   list(src.TEMPLATES))
    return write_manifest(out, common, summary, **extra)


def check_demo_out(out: Path, overwrite: bool) -> None:
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
    # demo:mnist's and demo:openmoji's per-pixel labelled sets (data_tools/dense.py)
    ours |= {out / DENSE / f for f in DENSE_FILES}
    # demo:openmoji-all's second drawing style (data_tools/noto.py), also a clip_benchmark root
    ours |= {out / "noto" / f for f in NOTO_FILES}
    ours = {f for f in ours if f.is_file()}
    foreign = [t for sub in ("train", "test") for t in foreign_tars(out / sub, ours)]
    if foreign:
        raise BuildError(f"{out} holds {foreign[0]} ({len(foreign)} tar file(s)) that no build wrote: the demo's "
                         "shards would mix with them. Choose another --out")
    if existing:
        remove_files(ours)
