"""The record interface every build source implements (:class:`Record`, :class:`RangeSource`), what
they share (keys, reading the files a source names, :class:`SourceError`), and image decoding with skip
reasons."""

from __future__ import annotations

import io
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from data_tools.images import BadImage

# skip reasons (manifest `skipped` keys)
MISSING_FILE = "missing_file"
ZERO_BYTE = "zero_byte_file"
NOT_AN_IMAGE = "not_an_image"
TRUNCATED = "truncated_image"
TOO_MANY_PIXELS = "too_many_pixels"
MISSING_CAPTION = "missing_caption"
EMPTY_CAPTION = "empty_caption"
CAPTION_NOT_UTF8 = "caption_not_utf8"
DUPLICATE_KEY = "duplicate_key"
MISSING_IMAGE = "missing_image"
OUTSIDE_BASE_DIR = "outside_base_dir"
NOT_A_REGULAR_FILE = "not_a_regular_file"
FILE_TOO_LARGE = "file_too_large"
CAPTION_TOO_LONG = "caption_too_long"
BAD_EXTRA_CAPTIONS = "bad_extra_captions"
BAD_NEGATIVE_CAPTIONS = "bad_negative_captions"

# a caption past this is page text, not a caption (the text towers read 77 tokens, ~300 characters)
MAX_CAPTION_CHARS = 16_384


@dataclass
class Record:
    """One source item: image bytes (or a decoded image), caption, metadata; or the reason it is unusable."""

    key: str
    image: bytes | Image.Image | None = None
    caption: str | bytes | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def decode_caption(caption: str | bytes | None) -> str:
    if caption is None:
        raise BadImage(MISSING_CAPTION)
    if isinstance(caption, bytes):
        try:
            caption = caption.decode("utf-8")
        except UnicodeDecodeError:
            raise BadImage(CAPTION_NOT_UTF8) from None
    try:
        caption.encode("utf-8")
    except UnicodeEncodeError:  # undecodable bytes kept as surrogates by the table reader
        raise BadImage(CAPTION_NOT_UTF8) from None
    caption = caption.replace("\x00", "").strip()  # NUL bytes would end the caption in C tools
    if not caption:
        raise BadImage(EMPTY_CAPTION)
    if len(caption) > MAX_CAPTION_CHARS:
        raise BadImage(CAPTION_TOO_LONG, f"{len(caption)} characters")
    return caption


def caption_lists(meta: dict[str, Any], row: Any, columns: dict[str, str | None]) -> str | None:
    """Each ``{json field: column}`` list column of ``row`` (``row[column]``) into ``meta`` (``captions``:
    ``--extra-captions-column``, ``negative_captions``: ``--negative-captions-column``); the skip reason
    of a cell that is not a list of captions, else None."""
    for fieldname, column in columns.items():
        if not column:
            continue
        reason = BAD_NEGATIVE_CAPTIONS if fieldname == "negative_captions" else BAD_EXTRA_CAPTIONS
        try:
            if values := extra_captions(row[column], reason):
                meta[fieldname] = values
        except BadImage as e:
            return e.reason
    return None


def extra_captions(value: Any, reason: str = BAD_EXTRA_CAPTIONS) -> list[str]:
    """A caption-list cell (``--extra-captions-column``, ``--negative-captions-column``): a list of strings
    (parquet, HF ``Sequence``) or a JSON array of strings (TSV/CSV); empty or missing: []. Raises
    BadImage(``reason``)."""
    import json

    if value is None or (isinstance(value, str) and not value.strip()):
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise BadImage(reason, "not a JSON array of strings") from None
    if not isinstance(value, (list, tuple)) or not all(isinstance(c, str) for c in value):
        raise BadImage(reason, "not a list of strings")
    try:
        return [decode_caption(c) for c in value]
    except BadImage:
        raise BadImage(reason, "a caption in the list is empty, not UTF-8 or too long") from None


def decode_image(data: bytes | Image.Image | None, max_pixels: int) -> Image.Image:
    """Open and fully decode; raises BadImage with the skip reason."""
    if data is None:
        raise BadImage(MISSING_IMAGE)
    if isinstance(data, Image.Image):
        img = data
    else:
        if len(data) == 0:
            raise BadImage(ZERO_BYTE)
        try:
            img = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError:
            raise BadImage(TOO_MANY_PIXELS) from None
        except Exception:
            raise BadImage(NOT_AN_IMAGE) from None
    if img.width * img.height > max_pixels:  # checked on the header, before decoding
        raise BadImage(TOO_MANY_PIXELS, f"{img.width}x{img.height}")
    try:
        img.load()
    except Image.DecompressionBombError:
        raise BadImage(TOO_MANY_PIXELS) from None
    except Exception:
        raise BadImage(TRUNCATED) from None
    return img


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
