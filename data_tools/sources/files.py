"""File-based sources: tables (TSV/CSV/parquet) and image folders here; img2dataset output
(:mod:`~data_tools.sources.img2dataset`) and Hugging Face datasets (:mod:`~data_tools.sources.hf`) beside;
:func:`open_source` detects which a path is.

Each source lists its records deterministically, splits them into chunks (one chunk -> one output
shard, so the result does not depend on how many processes build it) and reads a chunk lazily in a
worker process. A source that cannot be read at all raises :class:`SourceError` (exit code 2)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from data_tools.sources.hf import HFSource
from data_tools.sources.img2dataset import Img2DatasetSource
from data_tools.sources.records import (
    MISSING_IMAGE,
    RangeSource,
    Record,
    SourceError,
    caption_lists,
    clean_key,
    read_source_file,
)

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")


class _Table:
    def __init__(self, columns: list[str], data: dict[str, list]):
        self.columns, self.data = list(columns), data

    def __len__(self) -> int:
        return len(self.data[self.columns[0]]) if self.columns else 0


class TableSource(RangeSource):
    """TSV/CSV/parquet with an image column (paths relative to ``base_dir``) and a caption column."""

    kind = "table"

    def __init__(self, path: str | Path, image_column: str, caption_column: str, base_dir: str | None,
                 key_column: str | None = None, extra_column: str | None = None, negative_column: str | None = None):
        self.path = Path(path)
        if not self.path.is_file():
            raise SourceError(f"{self.path}: no such table file")
        self.image_column, self.caption_column, self.key_column = image_column, caption_column, key_column
        self.extra_column, self.negative_column = extra_column, negative_column
        self.base_dir = Path(base_dir) if base_dir else self.path.parent
        self._df = None
        df = self._table()
        missing = [c for c in (image_column, caption_column, key_column, extra_column, negative_column)
                   if c and c not in df.columns]
        if missing:
            raise SourceError(
                f"{self.path}: column(s) {missing} not found; columns are {list(df.columns)} (choose with "
                "--image-column / --caption-column / --key-column / --extra-captions-column / --negative-captions-column)"
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
                    self._df = _Table(t.column_names, {c: t.column(c).to_pylist() if c in (self.extra_column, self.negative_column) else
                                                       [None if v is None else str(v) if not isinstance(v, bytes)
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
        bad = caption_lists(meta, {c: data[c][i] for c in (self.extra_column, self.negative_column) if c},
                            {"captions": self.extra_column, "negative_captions": self.negative_column})
        if bad:
            return Record(key, caption=caption, meta=meta, error=bad)
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
                base_dir: str | None, key_column: str | None, captions: str | None, extra_column: str | None = None,
                negative_column: str | None = None):
    kind = detect(source, source_type)
    for flag, column, fieldname in (("--extra-captions-column", extra_column, "captions"),
                                    ("--negative-captions-column", negative_column, "negative_captions")):
        if column and kind not in ("table", "hf"):
            raise SourceError(f"{flag} is for tables and HF datasets; {source} is a {kind} source "
                              f"(give them as '{fieldname}' in each sample's json)")
    if kind == "table":
        return TableSource(source, image_column or "image", caption_column or "caption", base_dir, key_column,
                           extra_column, negative_column)
    if kind == "folder":
        return FolderSource(source, captions)
    if kind == "img2dataset":
        return Img2DatasetSource(source)
    if kind == "hf":
        return HFSource(source, image_column or "image", caption_column or "text", extra_column, negative_column)
    raise SourceError(f"--source-type {kind!r}: choose table, folder, img2dataset, hf or demo")
