"""Keep-lists: which samples of a dataset training reads, without rewriting a shard. The one owner of
their format (written by ``python -m data_tools filter``, read by the training stream through
``data.keep``).

A keep-list folder ``LIST`` holds, per shard ``NAME.tar`` of the dataset it was made for::

    LIST/
      keep.json          {"format": "mmpretrain-keep-list", "version", "data", "rules": [{rule, settings,
                          removed}], "removed": {rule: count}, "total", "kept",
                          "shards": {NAME.tar: {total, kept, bytes, first_key, digest}}, "files": [...]}
      NAME.tar.keep.txt  the kept samples' keys, one a line, in the shard's order
      NAME.tar.keep.npy  int64 (kept,): their positions in the shard (0-based, ascending)

``removed`` counts each sample once, under the first rule (in ``rules`` order) that removed it. The
positions let the stream seek to a kept sample without reading the shard's keys first; the keys are
checked when a kept sample is read. ``bytes`` and ``first_key`` fingerprint the shard the list was
made from, so a list meets a rebuilt shard as one clear error at setup, never as other samples.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmpretrain.data.sidecar import join, read_folder_json, shard_bytes
from mmpretrain.data.urls import is_local, open_url, shard_path

log = logging.getLogger("mmpretrain.data")

KEEP = "keep.json"
FORMAT = "mmpretrain-keep-list"
VERSION = 1
KEYS = ".keep.txt"
POSITIONS = ".keep.npy"


def digest(positions: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(positions, dtype=np.int64).tobytes()).hexdigest()[:16]


def write_shard(folder: Path, name: str, positions: np.ndarray, keys: list[str]) -> list[str]:
    """One shard's two files (temporary file + rename each); returns their names."""
    positions = np.asarray(positions, dtype=np.int64)
    out = []
    for suffix, data in ((POSITIONS, None), (KEYS, "".join(k + "\n" for k in keys).encode("utf-8"))):
        final = folder / (name + suffix)
        tmp = final.with_name(final.name + ".tmp")
        with open(tmp, "wb") as f:
            if data is None:
                np.save(f, positions, allow_pickle=False)
            else:
                f.write(data)
        os.replace(tmp, final)
        out.append(final.name)
    return out


def read_list(folder: str) -> dict[str, Any]:
    """``keep.json`` of ``folder``, checked; ValueError / FileNotFoundError naming the fix."""
    if is_local(folder) and not Path(folder).is_dir():
        raise FileNotFoundError(f"data.keep: {folder} is not a folder; write a keep-list with `python -m data_tools "
                                "filter DATA --out LIST ...`")
    index = read_folder_json(folder, KEEP)
    if not isinstance(index, dict) or index.get("format") != FORMAT or not isinstance(index.get("shards"), dict):
        raise ValueError(f"data.keep: {join(folder, KEEP)} is missing or not a keep-list's index; write one with "
                         "`python -m data_tools filter DATA --out LIST ...`")
    if index.get("version", 0) > VERSION:
        raise ValueError(f"data.keep: {join(folder, KEEP)} has version {index['version']}; this mmpretrain reads "
                         f"up to {VERSION}: upgrade mmpretrain")
    return index


def _load_positions(folder: str, name: str) -> np.ndarray:
    with open_url(join(folder, name + POSITIONS)) as f:
        return np.load(io.BytesIO(f.read()), allow_pickle=False)


def load_keys(folder: str, name: str) -> list[str]:
    with open_url(join(folder, name + KEYS)) as f:
        return f.read().decode("utf-8").splitlines()


@dataclass
class ShardKeep:
    """A shard's kept positions; its keys are read when the stream opens the shard."""

    folder: str
    name: str
    positions: np.ndarray
    keys: list[str] | None = None

    def key(self, local: int) -> str | None:
        if self.keys is None:
            try:
                self.keys = load_keys(self.folder, self.name)
            except (OSError, UnicodeDecodeError) as e:
                log.warning("keep-list %s: keys unreadable (%s); its samples are read without the key check",
                            join(self.folder, self.name + KEYS), e)
                self.keys = []
        return self.keys[local] if local < len(self.keys) else None


def attach_keep(sources: list, spec: str | None) -> None:
    """Apply ``data.keep`` (one keep-list folder per ``::`` source; an empty part keeps all of that source):
    each source's ``sizes`` become its kept counts, ``full_sizes`` its shards' counts and ``keep`` one
    :class:`ShardKeep` per shard. Every mismatch with the data is a ValueError naming the shard and the fix."""
    if not spec:
        return
    parts = [p.strip() for p in spec.split("::")]
    if len(parts) != len(sources):
        raise ValueError(f"data.keep names {len(parts)} keep-list(s) for {len(sources)} source(s) of data.train: give "
                         "one per '::' source, in the same order (an empty one keeps all of its source)")
    for source, folder in zip(sources, parts):
        if not folder:
            continue
        index = read_list(folder)
        names = [posixpath.basename(shard_path(u)) for u in source.urls]
        shards = index["shards"]
        extra = sorted(set(shards) - set(names))
        if extra:
            raise ValueError(f"data.keep: {join(folder, KEEP)} names shard(s) that data.train source {source.spec!r} "
                             f"does not have: {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}. Give the "
                             f"list made for this data (its keep.json says it was made for {index.get('data')!r})")
        keeps, sizes = [], []
        for url, name, total in zip(source.urls, names, source.sizes):
            record = shards.get(name)
            if not isinstance(record, dict):
                raise ValueError(f"data.keep: {join(folder, KEEP)} has no entry for shard {name} of {source.spec!r} "
                                 "(the data gained shards after filtering): run `python -m data_tools filter` again")
            if record.get("total") != total:
                raise ValueError(f"data.keep: the list was made from {record.get('total')} samples of {name}, its "
                                 f"sizes.json now says {total}: the shard was rebuilt; run `python -m data_tools filter` again")
            nbytes = shard_bytes(url)
            if nbytes is not None and record.get("bytes") is not None and nbytes != record["bytes"]:
                raise ValueError(f"data.keep: {name} has {nbytes} bytes, {record['bytes']} when the list was made: the "
                                 "shard was rebuilt; run `python -m data_tools filter` again")
            try:
                pos = _load_positions(folder, name)
            except (OSError, ValueError, EOFError) as e:
                raise ValueError(f"data.keep: {join(folder, name + POSITIONS)} is unreadable ({e.__class__.__name__}: "
                                 f"{e}); run `python -m data_tools filter` again") from None
            ok = (pos.ndim == 1 and np.issubdtype(pos.dtype, np.integer) and len(pos) == record.get("kept")
                  and (len(pos) == 0 or (pos[0] >= 0 and pos[-1] < total and bool(np.all(np.diff(pos) > 0)))))
            if not ok:
                raise ValueError(f"data.keep: {join(folder, name + POSITIONS)} does not hold {record.get('kept')} "
                                 f"ascending positions below {total}, as keep.json says: run `python -m data_tools "
                                 "filter` again")
            keeps.append(ShardKeep(folder, name, pos.astype(np.int64)))
            sizes.append(len(pos))
        if sum(sizes) == 0:
            raise ValueError(f"data.keep: {folder} keeps no sample of {source.spec!r}; loosen the filter's rules")
        source.full_sizes, source.sizes, source.keep = list(source.sizes), sizes, keeps
        source.keep_record = {"list": folder, "rules": index.get("rules"), "kept": sum(sizes),
                              "total": sum(source.full_sizes), "digest": hashlib.sha1(
                                  "".join(k.name + digest(k.positions) for k in keeps).encode()).hexdigest()[:16]}
