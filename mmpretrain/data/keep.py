"""Keep-lists: which samples of a dataset training reads, without rewriting a shard. The one owner of
their format (written by ``python -m data_tools filter``, read by the training stream through
``data.keep``).

A keep-list folder ``LIST`` holds, per shard ``NAME.tar`` of the dataset it was made for::

    LIST/
      keep.json          {"format": "mmpretrain-keep-list", "version", "data", "rules": [{rule, settings,
                          removed}], "removed": {rule: count}, "total", "kept",
                          "shards": {NAME.tar: {total, kept, bytes, first_key, digest}}, "files": [...],
                          "digests": {file: sha1 of the bytes written}}
      NAME.tar.keep.txt  the kept samples' keys, one a line, in the shard's order
      NAME.tar.keep.npy  int64 (kept,): their positions in the shard (0-based, ascending)

``removed`` counts each sample once, under the first rule (in ``rules`` order) that removed it.
``digests`` is the filter's manifest: a later ``filter --out`` replaces or deletes a file of the folder
only when its bytes are still the ones recorded there, whatever else a hand-edited ``keep.json`` says. The
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

from mmpretrain.config.base import RemoteConfig
from mmpretrain.data.sidecar import join, load_folder_json, load_npy, shard_bytes, whole
from mmpretrain.data.urls import is_local, open_url, shard_path

log = logging.getLogger("mmpretrain.data")

KEEP = "keep.json"
FORMAT = "mmpretrain-keep-list"
VERSION = 1
KEYS = ".keep.txt"
POSITIONS = ".keep.npy"


def digest(positions: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(positions, dtype=np.int64).tobytes()).hexdigest()[:16]


def file_digest(path: Path) -> str | None:
    """The sha1 of a file's bytes (what ``keep.json``'s ``digests`` records of each file it wrote); None when
    there is no such file."""
    try:
        return hashlib.sha1(path.read_bytes()).hexdigest()
    except OSError:
        return None


def write_shard(folder: Path, name: str, positions: np.ndarray, keys: list[str]) -> dict[str, str]:
    """One shard's two files (temporary file + rename each); returns ``{file name: sha1 of its bytes}``."""
    buf = io.BytesIO()
    np.save(buf, np.asarray(positions, dtype=np.int64), allow_pickle=False)
    out = {}
    for suffix, data in ((POSITIONS, buf.getvalue()), (KEYS, "".join(k + "\n" for k in keys).encode("utf-8"))):
        final = folder / (name + suffix)
        tmp = final.with_name(final.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, final)
        out[final.name] = hashlib.sha1(data).hexdigest()
    return out


def read_list(folder: str, remote: RemoteConfig | None = None) -> dict[str, Any]:
    """``keep.json`` of ``folder``, checked; ValueError / FileNotFoundError naming the fix."""
    if is_local(folder) and not Path(folder).is_dir():
        raise FileNotFoundError(f"data.keep: {folder} is not a folder; write a keep-list with `python -m data_tools "
                                "filter DATA --out LIST ...`")
    where = join(folder, KEEP)
    try:
        index = load_folder_json(folder, KEEP, remote)
    except ValueError as e:
        raise ValueError(f"data.keep: {e}; run `python -m data_tools filter` again") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT or not isinstance(index.get("shards"), dict):
        raise ValueError(f"data.keep: {where} is missing or not a keep-list's index; write one with "
                         "`python -m data_tools filter DATA --out LIST ...`")
    problem = _problem(index)
    if problem:
        raise ValueError(f"data.keep: {where}: {problem}: the file was edited or damaged; run `python -m data_tools "
                         "filter` again")
    if index["version"] > VERSION:
        raise ValueError(f"data.keep: {where} has version {index['version']}; this mmpretrain reads up to {VERSION}: "
                         "upgrade mmpretrain")
    return index


def _problem(index: dict[str, Any]) -> str | None:
    """What is wrong with a keep.json's fields (the key and its value), None when they are sound."""
    if not whole(index.get("version"), 1):
        return f"version is {index.get('version')!r}, not a whole number"
    for name, rec in index["shards"].items():
        if not isinstance(rec, dict):
            return f"shards.{name} is {rec!r}, not an object"
        for key, ok in (("total", whole), ("kept", whole), ("bytes", lambda v: v is None or whole(v)),
                        ("first_key", lambda v: v is None or isinstance(v, str))):
            if not ok(rec.get(key)):
                return f"shards.{name}.{key} is {rec.get(key)!r}, not {'a string' if key == 'first_key' else 'a whole number'}"
    return None


def _load_positions(folder: str, name: str, remote: RemoteConfig | None = None) -> np.ndarray:
    return load_npy(join(folder, name + POSITIONS), remote)


def load_keys(folder: str, name: str, remote: RemoteConfig | None = None) -> list[str]:
    with open_url(join(folder, name + KEYS), remote) as f:
        return f.read().decode("utf-8").splitlines()


@dataclass
class ShardKeep:
    """A shard's kept positions; its keys are read when the stream opens the shard."""

    folder: str
    name: str
    positions: np.ndarray
    keys: list[str] | None = None
    remote: RemoteConfig | None = None  # its source's data.remote

    def key(self, local: int) -> str | None:
        if self.keys is None:
            try:
                self.keys = load_keys(self.folder, self.name, self.remote)
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
        index = read_list(folder, source.remote)
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
            nbytes = shard_bytes(url, source.remote)
            if nbytes is not None and record.get("bytes") is not None and nbytes != record["bytes"]:
                raise ValueError(f"data.keep: {name} has {nbytes} bytes, {record['bytes']} when the list was made: the "
                                 "shard was rebuilt; run `python -m data_tools filter` again")
            try:
                pos = _load_positions(folder, name, source.remote)
            except ValueError as e:  # load_npy's words name the file
                raise ValueError(f"data.keep: {e}; run `python -m data_tools filter` again") from None
            ok = (pos.ndim == 1 and np.issubdtype(pos.dtype, np.integer) and len(pos) == record.get("kept")
                  and (len(pos) == 0 or (pos[0] >= 0 and pos[-1] < total and bool(np.all(np.diff(pos) > 0)))))
            if not ok:
                raise ValueError(f"data.keep: {join(folder, name + POSITIONS)} does not hold {record.get('kept')} "
                                 f"ascending positions below {total}, as keep.json says: run `python -m data_tools "
                                 "filter` again")
            keeps.append(ShardKeep(folder, name, pos.astype(np.int64), remote=source.remote))
            sizes.append(len(pos))
        if sum(sizes) == 0:
            raise ValueError(f"data.keep: {folder} keeps no sample of {source.spec!r}; loosen the filter's rules")
        source.full_sizes, source.sizes, source.keep = list(source.sizes), sizes, keeps
        source.keep_record = {"list": folder, "rules": index.get("rules"), "kept": sum(sizes),
                              "total": sum(source.full_sizes), "digest": hashlib.sha1(
                                  "".join(k.name + digest(k.positions) for k in keeps).encode()).hexdigest()[:16]}
