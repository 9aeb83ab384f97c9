"""The one tar reader: raw WebDataset samples of a shard, as the training stream, the evaluation and
``data_tools`` read them.

A sample is ``{"__key__": key, suffix: bytes, ...}`` over consecutive members sharing a key, with
webdataset's naming rule (:func:`split_name`). :func:`read_tar` parses the 512-byte headers itself
(ustar, pax ``path``/``size`` records, GNU long names): about 5x faster than ``tarfile`` in stream
mode, which builds a TarInfo and parses every pax header into Python objects, and able to skip
samples without copying their bytes out (resuming inside a shard). A truncated or malformed tar
raises one of :data:`UNREADABLE` after yielding every sample it could read. Remote shards (fsspec
urls) are retried where they fail, from the first sample not yet delivered (mmpretrain/data/urls.py).
"""

from __future__ import annotations

import gzip
import io
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mmpretrain.config.base import RemoteConfig
from mmpretrain.data import urls
from mmpretrain.data.urls import MalformedTar, open_url

__all__ = ["UNREADABLE", "MalformedTar", "read_tar", "split_name", "tar_keys"]

# what reading a broken shard raises: a cut stream (EOFError), bad header fields (ValueError), I/O and
# gzip errors (OSError, zlib.error)
UNREADABLE = (OSError, EOFError, ValueError, zlib.error)


def split_name(name: str) -> tuple[str, str] | None:
    """webdataset's rule: key = the path up to the first dot of the file name, suffix = the rest,
    lower-cased (webdataset's ``group_by_keys``); a name whose file name has no dot, or starts with
    one, belongs to no sample (None)."""
    base = name.rsplit("/", 1)[-1]
    dot = base.find(".")
    if dot <= 0:
        return None
    return name[: len(name) - len(base) + dot], base[dot + 1:].lower()


def _members(f, pos: int = 0) -> Iterator[tuple[str, int, bool, int]]:
    """``(name, size, is_file, entry offset)`` of each tar member, leaving ``f`` at the member's data;
    the entry offset is where its first header (pax and long-name ones included) starts, counting from
    ``pos`` (the offset ``f`` starts at). A short read raises EOFError, unparsable fields MalformedTar."""
    long_name, pax_name, pax_size = None, None, None
    entry = pos
    while True:
        h = f.read(512)
        if len(h) < 512:
            if h.strip(b"\0"):
                raise EOFError("truncated tar header")
            return
        if not h.strip(b"\0"):
            return  # end-of-archive block
        size_field = h[124:136]
        try:
            if size_field[0] & 0x80:  # GNU base-256 size
                size = int.from_bytes(size_field[1:], "big")
            else:
                size = int(size_field.strip(b"\0 ") or b"0", 8)
        except ValueError as e:
            raise MalformedTar(f"bad tar header size field {bytes(size_field)!r}") from e
        kind = h[156:157]
        if kind in (b"x", b"g", b"L"):
            data = f.read(size)
            f.read(-size % 512)
            pos += 512 + size + (-size % 512)
            if len(data) < size:
                raise EOFError("truncated tar header data")
            if kind == b"L":
                long_name = data.rstrip(b"\0").decode("utf-8", "surrogateescape")
            elif kind == b"x":
                try:
                    i = 0
                    while i < len(data):
                        sp = data.index(b" ", i)
                        n = int(data[i:sp])
                        k, _, v = data[sp + 1:i + n - 1].partition(b"=")
                        if k == b"path":
                            pax_name = v.decode("utf-8", "surrogateescape")
                        elif k == b"size":
                            pax_size = int(v)
                        i += n
                except ValueError as e:
                    raise MalformedTar("bad pax header record") from e
            continue
        name = long_name or pax_name
        if name is None:
            name = h[0:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            prefix = h[345:500].split(b"\0", 1)[0]
            if prefix and h[257:262] == b"ustar":
                name = prefix.decode("utf-8", "surrogateescape") + "/" + name
        if pax_size is not None:
            size = pax_size
        long_name, pax_name, pax_size = None, None, None
        yield name, size, kind in (b"0", b"\0", b"7"), entry
        pos += 512 + size + (-size % 512)
        entry = pos


def read_tar(url: str | Path, skip: int = 0, only: tuple[str, ...] | None = None,
             remote: RemoteConfig | None = None) -> Iterator[dict[str, Any]]:
    """Samples of one shard (local path, ``file://``, ``pipe:``, fsspec url; plain or gzipped), after
    ``skip`` samples whose bytes are never copied out; ``only``: the member suffixes to read (the
    others are skipped, e.g. the images when only captions are wanted). Raises one of
    :data:`UNREADABLE` on an unreadable or truncated tar, after yielding what it read; a remote shard
    is first retried under ``remote``'s options (:mod:`mmpretrain.data.urls`)."""
    url = str(url)
    if urls.is_remote(url):
        yield from _read_remote(url, skip, only, remote or urls.DEFAULT_REMOTE)
        return
    raw = open_url(url)
    try:
        for sample, _ in _samples(_buffered(raw), skip, only):
            yield sample
    finally:
        raw.close()


def _samples(stream, skip: int, only: tuple[str, ...] | None, pos: int = 0) -> Iterator[tuple[dict[str, Any], int | None]]:
    """``(sample, offset of the next sample's first header)`` (None after the last) from ``stream``,
    which starts at byte ``pos`` of the tar."""
    key, sample, n = None, {}, 0
    for name, size, is_file, entry in _members(stream, pos):
        parts = split_name(name) if is_file else None
        if parts is not None and parts[0] != key:
            if key is not None:
                if n >= skip:
                    yield sample, entry
                n += 1
            key, sample = parts[0], {"__key__": parts[0]}
        pad = -size % 512
        if parts is not None and n >= skip and (only is None or parts[1] in only):
            data = stream.read(size)
            if len(data) < size:
                raise EOFError(f"tar member {name} cut short")
            sample[parts[1]] = data
            if len(stream.read(pad)) < pad:
                raise EOFError(f"tar member {name}'s padding cut short")
        else:
            _skip(stream, size + pad)
    if key is not None and n >= skip:
        yield sample, None


def _read_remote(url: str, skip: int, only: tuple[str, ...] | None, opts: RemoteConfig) -> Iterator[dict[str, Any]]:
    """:func:`read_tar` of a remote shard with retries: after a failure the shard is re-opened at the
    first sample not yet delivered (a seek, i.e. a range request), or re-read with those samples
    skipped when it is gzipped; the attempt count restarts once a sample has come through."""
    delivered, offset, attempt = 0, None, 0
    while True:
        raw = None
        try:
            raw = urls.open_remote(url, opts)
            if offset is not None and raw.seekable():
                raw.seek(offset)
                stream = _buffered(raw)
                it = _samples(stream, 0, only, offset)
            else:
                stream = _buffered(raw)
                it = _samples(stream, skip + delivered, only)
            gzipped = isinstance(getattr(stream, "raw", None), gzip.GzipFile)
            for sample, nxt in it:
                delivered += 1
                attempt = 0
                offset = None if gzipped else nxt
                yield sample
            return
        except Exception as e:
            if not urls.retryable(e) or attempt >= opts.retries:
                raise _unreadable(e, url, attempt) from e
            attempt += 1
            urls.retry_wait(url, attempt, e, opts)
        finally:
            if raw is not None:
                try:
                    raw.close()
                except Exception:  # a broken connection may fail to close as well
                    pass


def _unreadable(e: BaseException, url: str, attempts: int) -> BaseException:
    """The error a remote shard gives up with, as one of :data:`UNREADABLE` (the HTTP client's errors are
    not OSErrors), naming the url, the cause and the retries made."""
    if isinstance(e, UNREADABLE) and not attempts:
        return e
    return OSError(f"{url}: {urls.describe(e)}" + (f" (after {attempts} retries)" if attempts else ""))


def tar_keys(url: str | Path, remote: RemoteConfig | None = None) -> Iterator[str]:
    """The sample keys of one shard in order, from its headers alone (member data is skipped, not
    copied out). Raises one of :data:`UNREADABLE` like :func:`read_tar`, after the keys it read."""
    raw = open_url(str(url), remote)
    try:
        stream = _buffered(raw)
        last = None
        for name, size, is_file, _ in _members(stream):
            parts = split_name(name) if is_file else None
            if parts is not None and parts[0] != last:
                last = parts[0]
                yield last
            _skip(stream, size + (-size % 512))
        if stream.seekable() and stream.tell() > stream.seek(0, io.SEEK_END):  # skipped past the end
            raise EOFError(f"{url}: the last member's data is cut short")
    finally:
        raw.close()


def _buffered(raw):
    """A peekable stream over ``raw``, gunzipped when it is gzip."""
    stream = raw
    if not hasattr(stream, "peek"):
        stream = io.BufferedReader(stream if hasattr(stream, "readinto") else _RawAdapter(stream), 1 << 20)
    if stream.peek(2)[:2] == b"\x1f\x8b":
        stream = io.BufferedReader(gzip.GzipFile(fileobj=stream), 1 << 20)
    return stream


class _RawAdapter(io.RawIOBase):
    """A raw stream over anything with ``read(n)`` (webdataset's ``Pipe``)."""

    def __init__(self, src):
        self.src = src

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        data = self.src.read(len(b))
        b[: len(data)] = data
        return len(data)


def _skip(f, n: int) -> None:
    if n and f.seekable():
        f.seek(n, io.SEEK_CUR)
        return
    while n > 0:
        chunk = f.read(min(n, 1 << 20))
        if not chunk:
            raise EOFError("tar data cut short")
        n -= len(chunk)
