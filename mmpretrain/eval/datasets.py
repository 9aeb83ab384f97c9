"""Evaluation datasets: clip_benchmark's offline ``wds`` layout, this project's shards, image folders
(one subfolder per class) and Hugging Face datasets.

``SPEC``: a folder with ``test/nshards.txt`` (and ``classnames.txt`` for classification) is clip_benchmark's layout
(``wds:DIR`` forces it); one with ``sizes.json`` our shards (``shards:DIR``), with captions from
``txt``, labels from ``json`` (``label``) and class names from the manifest; a ``save_to_disk`` folder
or ``hf:NAME[:SPLIT]`` a Hugging Face dataset; any other folder of class subfolders an image folder
(``folder:DIR``).
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from mmpretrain.data.decode import IMAGE_EXTS, parse_label
from mmpretrain.data.manifest import read_manifest, read_sizes
from mmpretrain.data.tar import UNREADABLE, read_tar, tar_keys


class BadEvalData(ValueError):
    """The dataset is there but does not hold what evaluation needs (exit 1, not a usage error)."""


def check_shards(spec: str, shards: list[Path]) -> None:
    """Every shard present, a readable tar, and at least one sample among them: checked from the tar
    headers before any model loads (an HTML error page saved as ``0.tar`` was a traceback mid-run)."""
    missing = [p for p in shards if not p.is_file()]
    if missing:
        raise BadEvalData(f"--dataset {spec}: {len(missing)} of {len(shards)} shards missing (first: {missing[0]}); "
                          "fix nshards.txt / sizes.json or fetch the shards again")
    samples = 0
    for p in shards:
        try:
            samples += sum(1 for _ in tar_keys(p))
        except UNREADABLE as e:
            raise BadEvalData(f"--dataset {spec}: {p} is not a readable tar ({e.__class__.__name__}: {e}; "
                              f"{p.stat().st_size} bytes): download or build it again (python -m data_tools "
                              "verify checks shard folders)") from None
    if not samples:
        raise BadEvalData(f"--dataset {spec}: its {len(shards)} shard(s) hold no samples ({shards[0]}, ...)")


@dataclass
class EvalSample:
    key: str
    image: Image.Image | None  # None: undecodable, skipped and counted
    captions: list[str]
    label: int | None
    # a per-pixel label map (``seg.png``: one class index per pixel, the dense probe's); None without one
    mask: Image.Image | None = None
    skip: str | None = None  # why a sample without an image is left out (default: undecodable_image)


@dataclass
class EvalDataset:
    name: str
    shards: list[Path]
    classnames: list[str] | None
    templates: list[str] | None
    layout: str  # "wds", "shards", "folder" (files: (path, label)) or "hf"
    files: list[tuple[Path, int]] | None = None
    hf: object = None  # (datasets.Dataset, image column, label column or None, caption column or None)
    credit: dict | None = None  # the licence and attribution its manifest.json records (the card credits them)

    def __iter__(self) -> Iterator[EvalSample]:
        for _, s in self.indexed():
            yield s

    def num_samples(self) -> int | None:
        if self.layout == "folder":
            return len(self.files)
        if self.layout == "hf":
            return len(self.hf[0])
        if self.layout == "shards":
            root = self.shards[0].parent if self.shards else None
            return sum(read_sizes(root).values()) if root else 0
        return None  # clip_benchmark's layout does not record sample counts

    def indexed(self, rank: int = 0, world: int = 1, part: int = 0, parts: int = 1) -> Iterator[tuple[int, EvalSample]]:
        """``(i, sample)`` for the samples with ``i % world == rank`` and ``(i // world) % parts == part``
        (a rank's share split among its workers); other samples are not decoded."""

        def mine(i: int) -> bool:
            return i % world == rank and (i // world) % parts == part

        if self.layout == "folder":
            for i, (path, label) in enumerate(self.files):
                if mine(i):
                    yield i, EvalSample(path.stem, _rgb(Image.open, path), [], label)
            return
        if self.layout == "hf":
            ds, image_col, label_col, caption_col = self.hf
            for i in range(len(ds)):
                if not mine(i):
                    continue
                row = ds[i]
                caps = row[caption_col] if caption_col else []
                caps = [caps] if isinstance(caps, str) else list(caps)
                yield i, EvalSample(str(i), _rgb(lambda im: im, row[image_col]), caps,
                                    int(row[label_col]) if label_col else None)
            return
        i = -1
        for shard in self.shards:
            for raw in read_tar(shard):
                ext = next((e for e in IMAGE_EXTS if e in raw), None)
                if ext is None:
                    continue
                i += 1
                if not mine(i):
                    continue
                image = _rgb(Image.open, io.BytesIO(raw[ext]))
                captions = []
                if "txt" in raw:
                    captions = [c for c in raw["txt"].decode("utf-8", "replace").splitlines() if c.strip()]
                mask = _mask(raw["seg.png"]) if "seg.png" in raw else None
                yield i, EvalSample(raw["__key__"], image, captions, parse_label(raw), mask)


def _rgb(open_image, source) -> Image.Image | None:
    """``open_image(source)`` decoded to RGB, or None when it does not decode (the loop skips and counts it)."""
    try:
        return open_image(source).convert("RGB")
    except Exception:  # PIL raises many kinds for bad bytes
        return None


def _mask(data: bytes) -> Image.Image | None:
    """A ``seg.png`` label map as an 8-bit single-band image, or None when it does not decode or is not
    one band (the dense probe skips and counts the sample)."""
    try:
        mask = Image.open(io.BytesIO(data))
        mask.load()
    except Exception:  # PIL raises many kinds for bad bytes
        return None
    return mask if mask.mode in ("L", "P") else None


def _read_lines(p: Path) -> list[str]:
    return [line.strip() for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]


IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp")


def _image_folder(root: Path, name: str | None) -> EvalDataset:
    """One subfolder per class (sorted names are the class names)."""
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    files = [(f, i) for i, c in enumerate(classes) for f in sorted((root / c).rglob("*"))
             if f.suffix.lower() in IMAGE_SUFFIXES]
    if not files:
        raise FileNotFoundError(f"--dataset {root}: no images in class subfolders")
    return EvalDataset(name or root.resolve().name, [], [c.replace("_", " ") for c in classes], None, "folder",
                       files=files)


def _hf_dataset(spec: str, name: str | None) -> EvalDataset:
    """``hf:NAME[:SPLIT]`` (offline only when cached) or a ``save_to_disk`` folder; image column
    ``image``/``img``, labels from ``label``/``labels`` (class names from the feature), captions from
    ``text``/``caption``/``captions``."""
    import datasets

    if spec.startswith("hf:"):
        hub, _, split = spec[3:].partition(":")
        ds = datasets.load_dataset(hub, split=split or "test")
        default = f"{hub.replace('/', '_')}-{split or 'test'}"
    else:
        ds = datasets.load_from_disk(spec)
        default = Path(spec).resolve().name
    cols = ds.column_names
    image_col = next((c for c in ("image", "img") if c in cols), None)
    if image_col is None:
        raise FileNotFoundError(f"--dataset {spec}: no image column (image or img) among {cols}")
    label_col = next((c for c in ("label", "labels") if c in cols), None)
    caption_col = next((c for c in ("text", "caption", "captions") if c in cols), None)
    classnames = None
    if label_col and isinstance(ds.features[label_col], datasets.ClassLabel):
        classnames = [c.replace("_", " ") for c in ds.features[label_col].names]
    return EvalDataset(name or default, [], classnames, None, "hf", hf=(ds, image_col, label_col, caption_col))


def _credit(root: Path) -> dict | None:
    try:
        manifest = read_manifest(root)
    except (OSError, ValueError):  # an unreadable manifest: no credit recorded, the data still evaluates
        return None
    credit = {k: manifest[k] for k in ("license", "attribution") if isinstance(manifest.get(k), str)}
    return credit or None


def _nshards(split: Path) -> int:
    text = (split / "nshards.txt").read_text(errors="replace").strip()
    if not text.isdigit() or int(text) < 1:
        raise BadEvalData(f"{split / 'nshards.txt'} holds {text[:40]!r}: it must be the number of tars "
                          "(0.tar, 1.tar, ...) in that folder")
    return int(text)


def load_dataset(spec: str, name: str | None = None) -> EvalDataset:
    ds = _load_dataset(spec, name)
    if ds.layout in ("wds", "shards"):
        check_shards(spec, ds.shards)
    return ds


def _load_dataset(spec: str, name: str | None = None) -> EvalDataset:
    if spec.startswith("hf:"):
        return _hf_dataset(spec, name)
    kind = None
    for prefix in ("wds:", "shards:", "folder:"):
        if spec.startswith(prefix):
            kind, spec = prefix[:-1], spec[len(prefix):]
    root = Path(spec)
    if not root.is_dir():
        raise FileNotFoundError(f"--dataset {spec}: no such folder")
    if kind is None:
        if (root / "test" / "nshards.txt").is_file():
            kind = "wds"
        elif (root / "sizes.json").is_file():
            kind = "shards"
        elif (root / "dataset_info.json").is_file() or (root / "state.json").is_file():
            return _hf_dataset(str(root), name)
        elif any(p.is_dir() for p in root.iterdir()):
            kind = "folder"
    if kind == "folder":
        return _image_folder(root, name)
    if kind == "wds":
        n = _nshards(root / "test")
        templates_file = root / "zeroshot_classification_templates.txt"
        return EvalDataset(
            name=name or f"{root.resolve().name}-test",
            shards=[root / "test" / f"{i}.tar" for i in range(n)],
            classnames=_read_lines(root / "classnames.txt") if (root / "classnames.txt").is_file() else None,
            templates=_read_lines(templates_file) if templates_file.is_file() else None,
            layout="wds",
            credit=_credit(root),
        )
    if kind == "shards":
        manifest = read_manifest(root)
        return EvalDataset(
            name=name or f"{root.resolve().parent.name}-{root.resolve().name}",
            shards=[root / s for s in sorted(read_sizes(root))],
            classnames=manifest.get("classnames"),
            templates=None,
            layout="shards",
            credit=_credit(root),
        )
    raise FileNotFoundError(
        f"--dataset {spec}: neither clip_benchmark's wds layout (test/nshards.txt), a "
        "shard folder (sizes.json), a saved HF dataset, nor an image folder with one subfolder per class"
    )


def load_splits(spec: str, need_train: bool = True) -> tuple[EvalDataset | None, EvalDataset]:
    """``(train, test)`` for probes: a folder with ``train/`` and ``test/`` shard folders (as
    ``data_tools build`` writes them), or clip_benchmark's layout with ``train/`` and ``test/`` tars.
    Clustering needs only a test split: any dataset ``load_dataset`` reads works."""
    root = Path(spec.split(":", 1)[1] if spec.startswith(("wds:", "shards:")) else spec)
    if not spec.startswith("hf:") and not root.is_dir():
        raise FileNotFoundError(f"--dataset {spec}: no such folder")
    if (root / "train" / "sizes.json").is_file() and (root / "test" / "sizes.json").is_file():
        name = f"{root.resolve().name}-test"
        return (load_dataset(str(root / "train"), name=f"{root.resolve().name}-train") if need_train else None,
                load_dataset(str(root / "test"), name=name))
    if (root / "train" / "nshards.txt").is_file() and (root / "test" / "nshards.txt").is_file():
        test = load_dataset("wds:" + str(root))
        n = _nshards(root / "train")
        check_shards(spec, [root / "train" / f"{i}.tar" for i in range(n)])
        train = EvalDataset(f"{root.resolve().name}-train", [root / "train" / f"{i}.tar" for i in range(n)],
                            test.classnames, test.templates, "wds")
        return (train if need_train else None), test
    if need_train:
        raise FileNotFoundError(
            f"--dataset {spec}: linear_probe and knn need a training split: a folder with train/ and test/ "
            "shard folders (data_tools build writes them) or clip_benchmark's layout with train/ and test/"
        )
    return None, load_dataset(spec)


def check_labels(ds: EvalDataset, labels, num_classes: int) -> None:
    """Labels must index the class names: a label past them would be scored against the wrong classes
    (a classnames.txt shorter than the labels reported acc1 0.117 with mean_per_class_recall 1.0)."""
    if len(labels) and (int(labels.max()) >= num_classes or int(labels.min()) < 0):
        raise ValueError(f"{ds.name}: labels run from {int(labels.min())} to {int(labels.max())} but there are "
                         f"{num_classes} class names (classnames.txt, or the manifest's classnames): give one "
                         "name per label")
