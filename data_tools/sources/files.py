"""File-based sources: tables (TSV/CSV/parquet), image folders, img2dataset output, Hugging Face datasets.

Each source lists its records deterministically, splits them into chunks (one chunk -> one output
shard, so the result does not depend on how many processes build it) and reads a chunk lazily in a
worker process. A source that cannot be read at all raises :class:`SourceError` (exit code 2)."""

from __future__ import annotations

import json
import re
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from data_tools.sources.records import (
    FILE_TOO_LARGE,
    MISSING_FILE,
    MISSING_IMAGE,
    NOT_A_REGULAR_FILE,
    OUTSIDE_BASE_DIR,
    Record,
)
from mmpretrain.data.decode import IMAGE_EXTS
from mmpretrain.data.tar import UNREADABLE, read_tar, tar_keys

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")


class SourceError(ValueError):
    """The source cannot be read at all (bad path, missing column, unknown format): exit code 2."""


def clean_key(raw: str) -> str:
    """A WebDataset key: no dots (the extension starts at the first dot) and no path separators."""
    return re.sub(r"[^A-Za-z0-9_\-]", "_", raw)


# a source file past this is not an image to re-encode (a 64-megapixel RGB PNG is ~200 MB)
MAX_FILE_BYTES = 1 << 30


def read_source_file(path: str | Path, base: Path | None = None) -> tuple[bytes | None, str | None]:
    """``(bytes, None)`` or ``(None, skip reason)`` for a file a source names. A relative ``path`` is
    taken against ``base`` and, symlinks followed, may not leave it (``outside_base_dir``); an absolute
    one is taken as given. Only regular files are read: a named pipe would block the build, a device
    such as /dev/zero would fill the memory."""
    p = Path(path)
    if base is not None and not p.is_absolute():
        p = base / p
        try:
            inside = p.resolve().is_relative_to(base.resolve())
        except (OSError, RuntimeError):  # a symlink loop
            return None, MISSING_FILE
        if not inside:
            return None, OUTSIDE_BASE_DIR
    try:
        st = p.stat()
    except (OSError, ValueError):  # missing, permission, a NUL in the name
        return None, MISSING_FILE
    if not stat.S_ISREG(st.st_mode):
        return None, NOT_A_REGULAR_FILE
    if st.st_size > MAX_FILE_BYTES:
        return None, FILE_TOO_LARGE
    try:
        with open(p, "rb") as f:
            return f.read(MAX_FILE_BYTES + 1), None
    except OSError:
        return None, MISSING_FILE


class RangeSource:
    """A source with random access to ``len(self)`` records."""

    kind = "range"

    def __len__(self) -> int:
        raise NotImplementedError

    def keys(self) -> list[str]:
        raise NotImplementedError

    def record(self, i: int) -> Record:
        raise NotImplementedError

    def keys_by_chunk(self, chunks: list[tuple[int, int]]) -> list[list[str]]:
        keys = self.keys()
        return [keys[a:b] for a, b in chunks]

    def chunks(self, size: int) -> list[tuple[int, int]]:
        n = len(self)
        return [(i, min(i + size, n)) for i in range(0, n, size)]

    def read_chunk(self, chunk: tuple[int, int]) -> Iterator[Record]:
        for i in range(*chunk):
            yield self.record(i)


class _Table:
    def __init__(self, columns: list[str], data: dict[str, list]):
        self.columns, self.data = list(columns), data

    def __len__(self) -> int:
        return len(self.data[self.columns[0]]) if self.columns else 0


class TableSource(RangeSource):
    """TSV/CSV/parquet with an image column (paths relative to ``base_dir``) and a caption column."""

    kind = "table"

    def __init__(self, path: str | Path, image_column: str, caption_column: str, base_dir: str | None,
                 key_column: str | None = None):
        self.path = Path(path)
        if not self.path.is_file():
            raise SourceError(f"{self.path}: no such table file")
        self.image_column, self.caption_column, self.key_column = image_column, caption_column, key_column
        self.base_dir = Path(base_dir) if base_dir else self.path.parent
        self._df = None
        df = self._table()
        missing = [c for c in (image_column, caption_column, key_column) if c and c not in df.columns]
        if missing:
            raise SourceError(
                f"{self.path}: column(s) {missing} not found; columns are {list(df.columns)} "
                "(choose with --image-column / --caption-column / --key-column)"
            )
        first = next((str(v) for v in df.data[image_column][:20] if v), "")
        if re.match(r"^[a-z]+://", first):
            raise SourceError(
                f"{self.path}: column {image_column!r} holds URLs ({first[:60]}...); download the images "
                "first with img2dataset (--output_format webdataset) and build from its output folder"
            )

    def _table(self) -> _Table:
        if self._df is None:
            suffix = self.path.suffix.lower()
            try:
                if suffix == ".parquet":
                    import pyarrow.parquet as pq

                    t = pq.read_table(self.path)
                    self._df = _Table(t.column_names, {c: [None if v is None else str(v) if not isinstance(v, bytes)
                                                            else v for v in t.column(c).to_pylist()]
                                                       for c in t.column_names})
                elif suffix in (".tsv", ".csv", ".txt"):
                    import csv

                    # undecodable bytes survive as surrogates; such a caption is skipped and counted later;
                    # a field past csv's 131,072-character default would reject the whole table: a long
                    # caption is skipped and counted later (caption_too_long)
                    csv.field_size_limit(1 << 30)
                    with open(self.path, newline="", encoding="utf-8", errors="surrogateescape") as f:
                        reader = csv.reader(f, delimiter="," if suffix == ".csv" else "\t",
                                            quoting=csv.QUOTE_MINIMAL if suffix == ".csv" else csv.QUOTE_NONE)
                        header = next(reader, None)
                        if header is None:
                            raise SourceError(f"{self.path}: empty table (no header row)")
                        rows = list(reader)
                    cols = {c: [r[i] if i < len(r) else "" for r in rows] for i, c in enumerate(header)}
                    self._df = _Table(header, cols)
                else:
                    raise SourceError(f"{self.path}: unknown table format {suffix!r}; use .tsv, .csv or .parquet")
            except SourceError:
                raise
            except Exception as e:
                raise SourceError(f"{self.path}: cannot be read as a table ({e})") from None
        return self._df

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_df"] = None  # each worker reads the table itself
        return state

    def __len__(self) -> int:
        return len(self._table())

    def keys(self) -> list[str]:
        df = self._table()
        if self.key_column:
            return [clean_key(str(k)) for k in df.data[self.key_column]]
        return [f"{i:09d}" for i in range(len(df))]

    def record(self, i: int) -> Record:
        data = self._table().data
        key = clean_key(str(data[self.key_column][i])) if self.key_column else f"{i:09d}"
        rel = data[self.image_column][i] or ""
        caption = data[self.caption_column][i]
        meta = {"source_row": i, "image_path": rel}
        if not rel:
            return Record(key, caption=caption, meta=meta, error=MISSING_IMAGE)
        data, error = read_source_file(rel, self.base_dir)
        return Record(key, image=data, caption=caption, meta=meta, error=error)


class FolderSource(RangeSource):
    """A folder of images; caption from a same-stem ``.txt`` or from a captions file
    (TSV/CSV with columns ``file`` and ``caption``, or a JSON object file -> caption)."""

    kind = "folder"

    def __init__(self, path: str | Path, captions: str | None = None):
        self.path = Path(path)
        if not self.path.is_dir():
            raise SourceError(f"{self.path}: no such folder")
        self.files = sorted(p.relative_to(self.path).as_posix() for p in self.path.rglob("*")
                            if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
        if not self.files:
            raise SourceError(f"{self.path}: no images ({', '.join(IMAGE_SUFFIXES)}) in this folder")
        self.captions: dict[str, str] | None = None
        if captions:
            self.captions = _read_captions(Path(captions))

    def __len__(self) -> int:
        return len(self.files)

    def keys(self) -> list[str]:
        return [clean_key(f.rsplit(".", 1)[0]) for f in self.files]

    def record(self, i: int) -> Record:
        rel = self.files[i]
        key = clean_key(rel.rsplit(".", 1)[0])
        if self.captions is not None:
            caption = self.captions.get(rel)
        else:
            caption = read_source_file(Path(rel).with_suffix(".txt"), self.path)[0]
        data, error = read_source_file(rel, self.path)
        return Record(key, image=data, caption=caption, meta={"image_path": rel}, error=error)


def _read_captions(path: Path) -> dict[str, str]:
    if not path.is_file():
        raise SourceError(f"--captions {path}: no such file")
    if path.suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise SourceError(f"--captions {path}: a JSON captions file maps file name -> caption")
        return {str(k): str(v) for k, v in data.items()}
    import pandas as pd

    df = pd.read_csv(path, sep="," if path.suffix == ".csv" else "\t", dtype=str, keep_default_na=False)
    if not {"file", "caption"} <= set(df.columns):
        raise SourceError(f"--captions {path}: needs columns 'file' and 'caption'; has {list(df.columns)}")
    return dict(zip(df["file"], df["caption"]))


class Img2DatasetSource:
    """img2dataset's webdataset output (``{i:05d}.tar`` with jpg/txt/json, plus parquet and stats),
    every sample validated and re-encoded. Each input tar is cut into output shards of at most
    ``--shard-size`` samples (img2dataset writes 10,000 per tar by default: CC3M's ~330 tars would
    otherwise be ~330 shards, too few for many ranks x workers); a chunk is ``(tar, start, stop)``,
    the last piece of each tar read to its end so that damage after its last readable header is
    still counted."""

    kind = "img2dataset"

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.tars = sorted(p.name for p in self.path.glob("*.tar"))
        if not self.tars:
            raise SourceError(f"{self.path}: no .tar files (is this img2dataset's webdataset output?)")
        self._keys: dict[str, list[str]] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_keys": {}}  # the key cache stays in the planning process

    def tar_keys(self, tar: str) -> list[str]:
        """A tar's sample keys from its headers alone; a damaged tar gives those before the damage
        (the rest is counted when it is read)."""
        if tar not in self._keys:
            keys: list[str] = []
            try:
                for k in tar_keys(self.path / tar):
                    keys.append(clean_key(k))
            except UNREADABLE:
                pass
            self._keys[tar] = keys
        return self._keys[tar]

    def chunks(self, size: int) -> list[tuple[str, int, int | None]]:
        out: list[tuple[str, int, int | None]] = []
        for tar in self.tars:
            n = len(self.tar_keys(tar))
            starts = list(range(0, n, size)) or [0]
            out += [(tar, a, a + size if a + size < n else None) for a in starts]
        return out

    def read_chunk(self, chunk: tuple[str, int, int | None]) -> Iterator[Record]:
        tar, start, stop = chunk
        try:
            for i, s in enumerate(read_tar(self.path / tar, skip=start), start):
                if stop is not None and i >= stop:
                    return
                ext = next((e for e in IMAGE_EXTS if e in s), None)
                meta: dict[str, Any] = {}
                if "json" in s:
                    try:
                        parsed = json.loads(s["json"])
                    except ValueError:
                        parsed = {}
                    if isinstance(parsed, dict):
                        meta = {k: v for k, v in parsed.items() if k in ("url", "key", "caption")}
                yield Record(clean_key(s["__key__"]), image=s.get(ext) if ext else None, caption=s.get("txt"),
                             meta=meta, error=None if ext else MISSING_IMAGE)
        except UNREADABLE:  # a cut or corrupt tar: what it held up to the damage was yielded
            yield Record(f"unreadable-{Path(tar).stem}-{start}", error="unreadable_tar")

    def keys_by_chunk(self, chunks: list[tuple[str, int, int | None]]) -> list[list[str]]:
        """The keys each chunk's samples will be written under, from the headers alone (a fraction of
        the cost of reading them)."""
        return [self.tar_keys(tar)[start:stop] for tar, start, stop in chunks]


class HFSource(RangeSource):
    """A Hugging Face dataset: a folder saved with ``save_to_disk`` or ``hf:NAME[:SPLIT]``."""

    kind = "hf"

    def __init__(self, spec: str, image_column: str, caption_column: str):
        self.spec, self.image_column, self.caption_column = spec, image_column, caption_column
        self._ds = None
        ds = self._dataset()
        missing = [c for c in (image_column, caption_column) if c not in ds.column_names]
        if missing:
            raise SourceError(f"{spec}: column(s) {missing} not found; columns are {ds.column_names} "
                              "(choose with --image-column / --caption-column)")

    def _dataset(self):
        if self._ds is None:
            import datasets

            try:
                if self.spec.startswith("hf:"):
                    name, _, split = self.spec[3:].partition(":")
                    ds = datasets.load_dataset(name, split=split or "train")
                else:
                    ds = datasets.load_from_disk(self.spec)
                    if isinstance(ds, datasets.DatasetDict):
                        raise SourceError(f"{self.spec}: a DatasetDict; build one split folder ({list(ds)})")
            except SourceError:
                raise
            except Exception as e:
                raise SourceError(f"{self.spec}: cannot load the dataset ({e})") from None
            if isinstance(ds.features.get(self.image_column), datasets.Image):
                ds = ds.cast_column(self.image_column, datasets.Image(decode=False))  # raw bytes: we decode
            self._ds = ds
        return self._ds

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_ds"] = None
        return state

    def __len__(self) -> int:
        return len(self._dataset())

    def keys(self) -> list[str]:
        return [f"{i:09d}" for i in range(len(self))]

    def record(self, i: int) -> Record:
        row = self._dataset()[i]
        img = row[self.image_column]
        data, error = img, None  # a PIL image or None
        if isinstance(img, dict):
            data = img.get("bytes")
            if data is None and img.get("path"):
                data, error = read_source_file(img["path"])
        elif isinstance(img, str):
            data, error = read_source_file(img)
        return Record(f"{i:09d}", image=data, caption=row[self.caption_column], meta={"source_row": i},
                      error=error or (MISSING_FILE if data is None else None))


def detect(source: str, source_type: str | None) -> str:
    """The source kind from the path (or ``--source-type``)."""
    if source_type:
        return source_type
    if source.startswith("hf:"):
        return "hf"
    p = Path(source)
    if p.is_file():
        if p.suffix.lower() in (".tsv", ".csv", ".parquet"):
            return "table"
        raise SourceError(f"{p}: unknown source file type {p.suffix!r}; give --source-type")
    if p.is_dir():
        if (p / "dataset_info.json").is_file() or (p / "state.json").is_file():
            return "hf"
        if any(p.glob("*.tar")):
            return "img2dataset"
        return "folder"
    raise SourceError(f"{source}: no such file or folder")


def open_source(source: str, source_type: str | None, *, image_column: str | None, caption_column: str | None,
                base_dir: str | None, key_column: str | None, captions: str | None):
    kind = detect(source, source_type)
    if kind == "table":
        return TableSource(source, image_column or "image", caption_column or "caption", base_dir, key_column)
    if kind == "folder":
        return FolderSource(source, captions)
    if kind == "img2dataset":
        return Img2DatasetSource(source)
    if kind == "hf":
        return HFSource(source, image_column or "image", caption_column or "text")
    raise SourceError(f"--source-type {kind!r}: choose table, folder, img2dataset, hf or demo")
