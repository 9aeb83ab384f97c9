"""img2dataset's webdataset output as a build source, cut into shards of ``--shard-size`` samples."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from data_tools.sources.records import MISSING_IMAGE, Record, SourceError, clean_key
from mmpretrain.data.decode import IMAGE_EXTS
from mmpretrain.data.tar import UNREADABLE, read_tar, tar_keys


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
