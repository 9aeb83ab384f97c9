"""Caption embeddings: the one owner of their formats. Beside the shards (never inside them), as DataComp
keeps per-sample features; datasets embedded before the sidecars carry an in-tar ``{key}.emb.npy`` member
(:data:`IN_TAR`, read by :func:`read_row`), which every reader still takes.

An embedding folder ``EMB_DIR`` (the dataset folder by default; any folder, local or fsspec, when the
shards are read-only or remote) holds, per shard ``NAME.tar``::

    EMB_DIR/
      embeddings.json        {"model", "dim", "normalized", "dtype", "shards": {NAME.tar: {count, bytes, first_key}}}
      NAME.tar.emb.npy       float16 (count, dim), L2-normalised, rows in the shard's sample order
      NAME.tar.keys.txt      the shard's sample keys, one a line, the same order
      NAME.tar.captions.npy  float16 (extra rows, dim): the extra captions' rows (``captions`` in {key}.json),
      NAME.tar.caption_offsets.npy  int64 (count + 1,): sample i's extra rows are [offsets[i], offsets[i+1])

The two extra-caption files exist for a shard whose record in ``embeddings.json`` (``version`` 2) has
``extra`` > 0; a version-1 index (caption 0 only) reads as before.

The training stream reads a shard's rows when it opens the shard. A sidecar that does not match the
shard it is read with (rows, keys or count other than the shard's, a shard of another byte size or
first key than the one embedded, an unreadable file) gives that shard's samples no embedding: each is
counted as ``missing_embedding`` and the reason is logged once per shard, never a crash; a sample whose
key is not the sidecar's key at its position is counted the same way. What can be seen before any work
-- no sidecar for any shard, a dimension other than the recorded one -- is refused at setup
(:func:`stored_dim`).
"""

from __future__ import annotations

import io
import json
import logging
import os
import posixpath
from pathlib import Path
from typing import Any

import numpy as np

from mmpretrain.config.base import RemoteConfig
from mmpretrain.data.tar import UNREADABLE, read_tar
from mmpretrain.data.urls import fs_kwargs, is_local, open_url, shard_path

log = logging.getLogger("mmpretrain.data")

INDEX = "embeddings.json"
EMB_SUFFIX = ".emb.npy"
KEYS_SUFFIX = ".keys.txt"
SUFFIXES = (EMB_SUFFIX, KEYS_SUFFIX)  # one shard's sidecar files: NAME.tar + suffix
EXTRA_SUFFIXES = (".captions.npy", ".caption_offsets.npy")  # and, with extra captions, these two
VERSION = 2  # embeddings.json's version: 2 added the extra captions' rows
LAYOUT = "sidecar"  # manifest.json's embedding.layout once `data_tools embed` wrote the sidecars
IN_TAR = "emb.npy"  # the earlier layout's member suffix ({key}.emb.npy inside the shard)


def read_row(data: bytes) -> np.ndarray:
    """An in-tar ``{key}.emb.npy`` member's array, never unpickled (an object array is a ValueError;
    empty, truncated or not .npy: ValueError, EOFError or OSError)."""
    return np.load(io.BytesIO(data), allow_pickle=False)


def recorded(source) -> dict[str, Any]:
    """``{model, dim, ...}`` of a source's stored caption embeddings: its sidecar ``embeddings.json``, else
    the manifest's record (of in-tar embeddings, or of sidecars that are not where the shards are); {}
    when there are none."""
    if source.embeddings is not None:
        return {k: v for k, v in source.embeddings.index.items() if k != "shards"}
    return source.manifest.get("embedding") or {}


def join(folder: str, name: str) -> str:
    return str(Path(folder) / name) if is_local(folder) else posixpath.join(folder, name)


def load_folder_json(emb_dir: str, name: str, remote: RemoteConfig | None = None) -> Any:
    """The JSON file ``name`` of the (local or fsspec) folder ``emb_dir``: None when there is none; a
    ValueError naming the file when it cannot be read or is not JSON (cut short, edited)."""
    url = join(emb_dir, name)
    try:
        if is_local(emb_dir):
            return json.loads(Path(url).read_text())
        with open_url(url, remote) as f:
            return json.loads(f.read())
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ValueError(f"{url} cannot be read ({e.__class__.__name__}: {e})") from None
    except ValueError as e:  # json's errors and UnicodeDecodeError
        raise ValueError(f"{url} is not valid JSON (cut short or edited: {e})") from None


def read_folder_json(emb_dir: str, name: str, remote: RemoteConfig | None = None) -> Any:
    """:func:`load_folder_json`, None also when the file is unreadable."""
    try:
        return load_folder_json(emb_dir, name, remote)
    except ValueError:
        return None


def whole(value: Any, least: int = 0) -> bool:
    """``value`` is an int (not a bool) of at least ``least``: what a count in our JSON files must be."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


NPY_MAGIC = b"\x93NUMPY"


def load_npy(url: str, remote: RemoteConfig | None = None) -> np.ndarray:
    """A ``.npy`` file's array, never unpickled; a ValueError naming the file and what is wrong with it
    (numpy's own words advise loading a pickle "unsafely", or call random bytes pickled data)."""
    try:
        with open_url(url, remote) as f:
            data = f.read()
    except FileNotFoundError:
        raise ValueError(f"{url} is missing") from None
    except OSError as e:
        raise ValueError(f"{url} cannot be read ({e.__class__.__name__}: {e})") from None
    if not data.startswith(NPY_MAGIC):
        raise ValueError(f"{url} is not a .npy array file ({'empty' if not data else 'it lacks the .npy header'}: "
                         "replaced, cut at its start, or another format)")
    try:
        return np.load(io.BytesIO(data), allow_pickle=False)
    except ValueError as e:
        if "allow_pickle" in str(e) or "Object arrays" in str(e):
            raise ValueError(f"{url} holds pickled Python objects, not an array of numbers (never loaded: "
                             "unpickling can run code)") from None
        raise ValueError(f"{url} is a damaged .npy file ({e})") from None
    except (EOFError, OSError):
        raise ValueError(f"{url} is a .npy file cut short") from None


def read_index(emb_dir: str, remote: RemoteConfig | None = None) -> dict[str, Any] | None:
    """``embeddings.json`` of ``emb_dir``, or None when there is none (or it is not a JSON object)."""
    data = read_folder_json(emb_dir, INDEX, remote)
    return data if isinstance(data, dict) and isinstance(data.get("shards"), dict) else None


def shard_bytes(url: str, remote: RemoteConfig | None = None) -> int | None:
    """A shard's size in bytes (None where it cannot be known without reading it: ``pipe:``)."""
    if url.startswith("pipe:"):
        return None
    path = url.removeprefix("file://")
    if is_local(path):
        try:
            return os.path.getsize(path)
        except OSError:
            return None
    import fsspec

    try:
        fs, p = fsspec.core.url_to_fs(path, **fs_kwargs(path, remote))
        return int(fs.size(p))
    except Exception:  # a remote that cannot say: the count and first key still fingerprint it
        return None


def write_shard(emb_dir: Path, name: str, keys: list[str], embs: np.ndarray,
                extra: tuple[np.ndarray, np.ndarray] | None = None) -> None:
    """One shard's sidecar files, each through a temporary file and a rename; ``extra``: the extra
    captions' ``(rows, offsets)``."""
    files = [(EMB_SUFFIX, lambda f: np.save(f, embs.astype(np.float16), allow_pickle=False)),
             (KEYS_SUFFIX, lambda f: f.write("".join(k + "\n" for k in keys).encode("utf-8")))]
    if extra is not None:
        files += [(EXTRA_SUFFIXES[0], lambda f: np.save(f, extra[0].astype(np.float16), allow_pickle=False)),
                  (EXTRA_SUFFIXES[1], lambda f: np.save(f, extra[1].astype(np.int64), allow_pickle=False))]
    for suffix, write in files:
        final = emb_dir / (name + suffix)
        tmp = final.with_name(final.name + ".tmp")
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, final)


def load_rows(emb_dir: str, name: str, remote: RemoteConfig | None = None) -> np.ndarray:
    """The embedding rows of shard ``name`` (never unpickled; :func:`load_npy`)."""
    return load_npy(join(emb_dir, name + EMB_SUFFIX), remote)


class ShardEmbeddings:
    """The sidecar rows of one shard, checked against the shard when it is opened."""

    def __init__(self, emb_dir: str, url: str, expected: int, index: dict[str, Any], warned: set[str] | None = None,
                 remote: RemoteConfig | None = None):
        self.name, self.remote = posixpath.basename(shard_path(url)), remote
        self.warned = set() if warned is None else warned  # the shards whose problem this process logged
        self.where = join(emb_dir, self.name + EMB_SUFFIX)
        self.rows: np.ndarray | None = None
        self.extra_rows: np.ndarray | None = None  # the extra captions' rows and per-sample offsets
        self.offsets: np.ndarray | None = None
        self.keys: list[str] = []
        self.reason: str | None = None
        try:
            self._load(emb_dir, url, expected, index)
        except ValueError as e:  # load_npy: missing, truncated, not .npy, a pickle (its words name the file)
            self.reason = str(e)
        except (OSError, UnicodeDecodeError) as e:  # the keys file
            self.reason = f"{self.name + KEYS_SUFFIX} unreadable ({e.__class__.__name__}: {e})"
        if self.reason:
            self.rows = None
        if self.reason and self.name not in self.warned:
            self.warned.add(self.name)
            log.warning("caption embeddings of %s: %s; the shard's %d sample(s) count as missing_embedding (run "
                        "`python -m data_tools embed` again)", url, self.reason, expected)

    def _load(self, emb_dir: str, url: str, expected: int, index: dict[str, Any]) -> None:
        record = index["shards"].get(self.name)
        if not isinstance(record, dict):
            self.reason = f"{INDEX} has no record of {self.name}"
            return
        rows = load_rows(emb_dir, self.name, self.remote)
        with open_url(join(emb_dir, self.name + KEYS_SUFFIX), self.remote) as f:
            keys = f.read().decode("utf-8").splitlines()
        dim = index.get("dim")
        nbytes = shard_bytes(url, self.remote)
        if rows.ndim != 2 or rows.dtype.kind != "f" or rows.shape[1] != dim:
            self.reason = f"shape {rows.shape} {rows.dtype}, {INDEX} says ({record.get('count')}, {dim}) floats"
        elif not (rows.shape[0] == len(keys) == record.get("count") == expected):
            self.reason = (f"{rows.shape[0]} rows and {len(keys)} keys for {record.get('count')} samples embedded, "
                           f"the shard holds {expected}")
        elif keys and keys[0] != record.get("first_key"):
            self.reason = f"first key {keys[0]!r}, {INDEX} says {record.get('first_key')!r}"
        elif nbytes is not None and record.get("bytes") is not None and nbytes != record["bytes"]:
            self.reason = f"the shard has {nbytes} bytes, {record['bytes']} when it was embedded: it was rebuilt"
        else:
            self.rows, self.keys = rows, keys
            if record.get("extra"):
                self._load_extra(emb_dir, dim, int(record["extra"]), expected)

    def _load_extra(self, emb_dir: str, dim: int, n_extra: int, expected: int) -> None:
        arrays = []
        for suffix in EXTRA_SUFFIXES:
            arrays.append(load_npy(join(emb_dir, self.name + suffix), self.remote))
        rows, offsets = arrays
        if rows.ndim != 2 or rows.dtype.kind != "f" or rows.shape != (n_extra, dim):
            self.reason = f"extra captions' rows of shape {rows.shape}, {INDEX} says ({n_extra}, {dim})"
        elif (offsets.shape != (expected + 1,) or offsets.dtype.kind not in "iu" or offsets[0] != 0
              or offsets[-1] != n_extra or bool((np.diff(offsets) < 0).any())):
            self.reason = f"extra captions' offsets of shape {offsets.shape} do not index {n_extra} rows of {expected} samples"
        else:
            self.extra_rows, self.offsets = rows, offsets

    def extra(self, pos: int) -> np.ndarray | None:
        """The rows of the extra captions of the sample at ``pos`` (after :meth:`row` accepted its key), in
        the order of its ``captions``; None without them."""
        if self.rows is None or self.offsets is None:
            return None
        return self.extra_rows[self.offsets[pos]:self.offsets[pos + 1]]

    def row(self, pos: int, key: str) -> np.ndarray | None:
        """The embedding of the sample at ``pos`` in the shard, if the sidecar's key there is ``key``."""
        if self.rows is None:
            return None
        if pos >= len(self.keys) or self.keys[pos] != key:
            if self.reason is None and self.name not in self.warned:
                self.warned.add(self.name)
                self.reason = f"key {key!r} at position {pos}, the sidecar has {self.keys[pos:pos + 1]}"
                log.warning("embeddings %s: %s (other key order): such samples count as missing_embedding",
                            self.where, self.reason)
            return None
        return self.rows[pos]


class SourceEmbeddings:
    """A source's embedding folder: ``for_shard(url, expected)`` gives the shard's checked rows."""

    def __init__(self, emb_dir: str, index: dict[str, Any], remote: RemoteConfig | None = None):
        self.emb_dir, self.index, self.remote = emb_dir, index, remote
        self.warned: set[str] = set()  # each shard's problem is logged once per process

    def for_shard(self, url: str, expected: int) -> ShardEmbeddings:
        return ShardEmbeddings(self.emb_dir, url, expected, self.index, self.warned, self.remote)


def _present(emb_dir: str, names: list[str], remote: RemoteConfig | None = None) -> list[str]:
    """The shards among ``names`` whose ``NAME.tar.emb.npy`` is in ``emb_dir``: a file check each (local),
    one listing (fsspec)."""
    if is_local(emb_dir):
        return [n for n in names if os.path.isfile(join(emb_dir, n + EMB_SUFFIX))]
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(emb_dir, **fs_kwargs(emb_dir, remote))
        listed = {posixpath.basename(p) for p in fs.ls(root, detail=False)}
    except Exception:  # a store that cannot list: each shard's file is checked when it opens
        return names
    return [n for n in names if n + EMB_SUFFIX in listed]


def _refuse_missing(source, model: str | None) -> None:
    """No shard of ``source`` has its sidecar file although the data records embeddings: every sample
    would be skipped as ``missing_embedding``. Raises ValueError naming a shard and the fixes."""
    names = [posixpath.basename(shard_path(u)) for u in source.urls]
    emb_dir = source.embeddings.emb_dir if source.embeddings is not None else (
        posixpath.dirname(shard_path(source.urls[0])) or ".")
    if source.embeddings is not None:
        if _present(emb_dir, names, source.remote):
            return
        what = f"{join(emb_dir, INDEX)} is there, but no shard's {EMB_SUFFIX} file (e.g. {join(emb_dir, names[0] + EMB_SUFFIX)})"
    elif (source.manifest.get("embedding") or {}).get("layout") == LAYOUT:
        what = (f"its manifest records embeddings beside the shards, but {emb_dir} holds no {INDEX} and no "
                f"{join(emb_dir, names[0] + EMB_SUFFIX)}: were the shards copied without them?")
    else:
        return  # in-tar embeddings: read with each sample
    raise ValueError(f"data.train source {source.spec}: {what}. Embed these shards (`python -m data_tools embed "
                     f"{source.spec} --model {model or 'MODEL'}`), or point data.embeddings at the folder `data_tools "
                     "embed` wrote them to (with '::' between the sources' folders); targets.source=online computes "
                     "them each step instead")


def stored_dim(sources: list, model: str | None = None) -> int:
    """The dimension of the caption embeddings stored for ``sources``, checked before training: every
    source has them where its record says (:func:`_refuse_missing`), all record one dimension, and
    each source's first stored rows have it. Raises ValueError naming the fix (``model``: the
    embedding model, for the commands it names). A dataset-wide problem is an error here; a single
    bad row is a ``bad_embedding`` skip in the stream."""
    for s in sources:
        _refuse_missing(s, model)
    dims = {s.spec: recorded(s).get("dim") for s in sources}
    if len(set(dims.values())) != 1 or not isinstance(next(iter(dims.values())), int):
        raise ValueError(f"data.train: the sources' manifests record embeddings of dimension {dims}: embed every "
                         f"source with `python -m data_tools embed DIR --model {model} --overwrite`")
    dim = next(iter(dims.values()))
    for s in sources:
        if s.embeddings is not None:  # the first sidecar's rows (each shard's are checked when it opens)
            first = next(iter(s.embeddings.index["shards"]), None)
            try:
                shape = load_rows(s.embeddings.emb_dir, first, s.remote).shape if first else None
            except (OSError, ValueError, EOFError):
                continue  # a damaged sidecar: its shard's samples are counted as missing_embedding
            if shape is not None and (len(shape) != 2 or shape[1] != dim):
                raise ValueError(f"{s.embeddings.emb_dir}: {first}{EMB_SUFFIX} has rows of shape {shape[1:]}, but "
                                 f"its {INDEX} records dimension {dim}: embed again (`python -m data_tools embed "
                                 f"{s.spec} --model {model} --overwrite`)")
            continue
        try:
            sample = next(read_tar(s.urls[0], remote=s.remote), None)
            shape = read_row(sample[IN_TAR]).shape if sample and IN_TAR in sample else None
        except (*UNREADABLE, KeyError):
            continue  # an unreadable shard or sample: the stream skips and counts it
        if shape is not None and shape != (dim,):
            raise ValueError(f"{s.urls[0]}: {sample['__key__']}.{IN_TAR} has shape {shape}, but the manifest of "
                             f"{s.spec} records dimension {dim}: re-embed it (`python -m data_tools embed DIR "
                             f"--model {model} --overwrite`)")
    return dim


def attach_embeddings(sources: list, spec: str | None) -> None:
    """Give each source its embedding folder: ``spec`` (``data.embeddings``: one folder per
    ``::``-joined source of ``data.train``, in the same order), else the folder of its shards when
    that holds an ``embeddings.json``. Raises FileNotFoundError / ValueError naming the setting."""
    dirs = [d.strip() for d in spec.split("::")] if spec else [""] * len(sources)
    if len(dirs) != len(sources):
        raise ValueError(f"data.embeddings has {len(dirs)} folder(s) for {len(sources)} source(s) of data.train: "
                         "give one per '::'-separated source, in the same order")
    for source, d in zip(sources, dirs):
        emb_dir = d or posixpath.dirname(shard_path(source.urls[0])) or "."
        index = read_index(emb_dir, source.remote)
        if d and index is None and os.path.isfile(join(emb_dir, "teachers.json")):
            continue  # a folder of teacher rows only (mmpretrain.data.teacher): no caption rows to attach
        if d and index is None:
            raise FileNotFoundError(f"data.embeddings: {emb_dir} holds no readable {INDEX}; write it with "
                                    f"`python -m data_tools embed {source.spec} --model MODEL --out {emb_dir}`")
        if index is not None:
            names = {posixpath.basename(shard_path(u)) for u in source.urls}
            if not names & set(index["shards"]):
                raise FileNotFoundError(f"data.embeddings: {join(emb_dir, INDEX)} records none of the shards of "
                                        f"{source.spec} (it embeds others, e.g. {next(iter(index['shards']), '-')}): "
                                        "give the folder `data_tools embed` wrote for these shards")
            source.embeddings = SourceEmbeddings(emb_dir, index, source.remote)


def check_extra_rows(sources: list, model: str | None = None) -> None:
    """A source whose manifest records extra captions (``extra_captions`` > 0) needs their rows: an
    ``embeddings.json`` of version 2. Raises ValueError naming the two fixes."""
    for s in sources:
        if not s.manifest.get("extra_captions") or s.embeddings is None:
            continue
        if "extra_captions" not in s.embeddings.index:
            raise ValueError(f"data.train source {s.spec}: its samples have {s.manifest['extra_captions']} extra "
                             f"captions, but {join(s.embeddings.emb_dir, INDEX)} was written before embed stored "
                             "their rows: embed again (`python -m data_tools embed "
                             f"{s.spec} --model {model or 'MODEL'}`: only the missing rows' shards are redone), "
                             "or train on caption 0 alone with data.captions=first")
