"""Teacher targets beside the shards: the one owner of their formats (written by ``data_tools embed
--image-model``, read by the training stream). As DataCompDR stores a CLIP ensemble's embeddings of
several augmentations of each image, with the augmentations' parameters, so training replays exactly
the crop the teacher saw.

In an embedding folder ``EMB_DIR`` (the dataset folder by default, as the caption sidecars), per shard
``NAME.tar``::

    EMB_DIR/
      teachers.json                      {"version", "augmentations": {count, seed, scale, ratio, sampler},
                                          "teachers": {TID: {model, pretrained, dim, image_size, ...,
                                                             "shards": {NAME.tar: {count, bytes, first_key, extra}}}}}
      NAME.tar.teacher_keys.txt          the shard's sample keys, one a line, in its sample order
      NAME.tar.crops.npy                 int32 (n, 1 + K, 4): row 0 (0, 0, H, W) the image's size (what the
                                          evaluation transform sees), rows 1..K the K training crops
                                          (top, left, height, width) in original pixels; -1 where the
                                          image could not be decoded
      NAME.tar.caption_counts.npy        int64 (n,): each sample's number of extra captions
      NAME.tar.teacher-TID.image.npy     float16 (n, 1 + K, E): the teacher's L2-normalised image
                                          embeddings of the evaluation view and of the K crops
      NAME.tar.teacher-TID.text.npy      float16 (n, E): of caption 0
      NAME.tar.teacher-TID.captions.npy  float16 (extra, E): of the extra captions, sample by sample

``teachers.json`` is its own index (``embeddings.json`` is the caption model's, rewritten by every
caption embed): adding a teacher never touches the caption rows, and several teachers (an ensemble)
share one set of crops, each its own block. Size: ``n (1 + K) E`` 2-byte numbers per teacher (CC3M's
2.9 M images at K = 10 and E = 1,536: ~98 GB).

A shard whose files do not match it (keys, counts, shapes, a rebuilt shard) gives its samples no
teacher rows: each is counted as ``missing_teacher``, the reason logged once per shard.
"""

from __future__ import annotations

import hashlib
import logging
import os
import posixpath
import re
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from mmpretrain.config.base import RemoteConfig
from mmpretrain.data.sidecar import join, load_folder_json, load_npy, read_folder_json, shard_bytes, whole
from mmpretrain.data.urls import open_url, shard_path

log = logging.getLogger("mmpretrain.data")

TEACHERS = "teachers.json"
TEACHER_VERSION = 1
KEYS = ".teacher_keys.txt"
CROPS = ".crops.npy"
COUNTS = ".caption_counts.npy"
SHARED = (KEYS, CROPS, COUNTS)  # the files every teacher of a shard shares


def teacher_files(tid: str) -> tuple[str, str, str]:
    """A teacher's per-shard suffixes: image rows, caption-0 rows, extra captions' rows."""
    return (f".teacher-{tid}.image.npy", f".teacher-{tid}.text.npy", f".teacher-{tid}.captions.npy")


def teacher_id(model: str, pretrained: str | None = None) -> str:
    """A file-name-safe id for a teacher: its name's last part, readable, plus a hash of the whole."""
    full = f"{model}@{pretrained}" if pretrained else model
    base = re.sub(r"[^A-Za-z0-9._-]+", "_", full.rstrip("/").rsplit("/", 1)[-1].removeprefix("hf-hub:"))[:40]
    return f"{base}-{hashlib.blake2b(full.encode(), digest_size=4).hexdigest()}"


def index_problem(data: Any) -> str | None:
    """What is wrong with a ``teachers.json``'s content (the key and its value), None when it is sound."""
    if not isinstance(data, dict) or not isinstance(data.get("augmentations"), dict):
        return "has no 'augmentations' object"
    if not whole(data["augmentations"].get("count")):
        return f"augmentations.count is {data['augmentations'].get('count')!r}, not a whole number"
    if not isinstance(data.get("teachers"), dict):
        return "has no 'teachers' object"
    for tid, block in data["teachers"].items():
        if not isinstance(block, dict) or not isinstance(block.get("model"), str):
            return f"teachers.{tid} has no 'model' name"
        if not whole(block.get("dim"), 1):
            return f"teachers.{tid}.dim is {block.get('dim')!r}, not a positive whole number"
        if not isinstance(block.get("shards"), dict):
            return f"teachers.{tid} has no 'shards' object"
        for name, rec in block["shards"].items():
            bad = "count" if not isinstance(rec, dict) or not whole(rec.get("count")) else next(
                (k for k in ("extra", "bytes") if not (rec.get(k) is None or whole(rec[k]))), None)
            if bad:
                got = rec.get(bad) if isinstance(rec, dict) else rec
                return f"teachers.{tid}.shards.{name}.{bad} is {got!r}, not a whole number"
    return None


def teachers_problem(emb_dir: str, fix: bool = True, remote: RemoteConfig | None = None) -> str | None:
    """Why ``emb_dir``'s ``teachers.json`` cannot be used, naming the file (and with ``fix``, the fix); None
    when it is sound or absent."""
    try:
        data = load_folder_json(emb_dir, TEACHERS, remote)
        problem = index_problem(data) if data is not None else None
        what = f"{join(emb_dir, TEACHERS)} {problem}: the file was edited or damaged" if problem else None
    except ValueError as e:
        what = str(e)
    return what and what + ("; embed the shards again (`python -m data_tools embed DATA --image-model M`)" if fix else "")


def read_teachers(emb_dir: str, remote: RemoteConfig | None = None) -> dict[str, Any] | None:
    """``teachers.json`` of ``emb_dir``, or None when there is none, or none sound (:func:`teachers_problem`
    says why)."""
    data = read_folder_json(emb_dir, TEACHERS, remote)
    return data if data is not None and index_problem(data) is None else None


def save_npy(path: Path, array: np.ndarray) -> None:
    """``array`` to ``path`` through a temporary file and a rename."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.save(f, array, allow_pickle=False)
    os.replace(tmp, path)


def _load(emb_dir: str, name: str, kinds: str = "f", remote: RemoteConfig | None = None) -> np.ndarray:
    """A shard file's array (:func:`~mmpretrain.data.sidecar.load_npy`), of numbers of the ``kinds`` given
    (numpy's dtype kinds: "f" floats, "iu" integers)."""
    array = load_npy(join(emb_dir, name), remote)
    if array.dtype.kind not in kinds:
        raise ValueError(f"{name} holds {array.dtype} values, not {'floats' if kinds == 'f' else 'integers'}")
    return array


class TeacherRows(NamedTuple):
    """One sample's stored teacher targets: ``crops (1 + K, 4)``, ``image (1 + K, sum E)`` (the members
    side by side), ``text (sum E,)`` for caption 0, ``extra (n_extra, sum E)``."""

    crops: np.ndarray
    image: np.ndarray
    text: np.ndarray
    extra: np.ndarray


class ShardTeachers:
    """The teacher rows of one shard for the teachers ``tids``, checked against the shard when opened."""

    def __init__(self, emb_dir: str, url: str, expected: int, index: dict[str, Any], tids: list[str],
                 warned: set[str], remote: RemoteConfig | None = None):
        self.name, self.remote = posixpath.basename(shard_path(url)), remote
        self.where = f"teacher rows of {self.name} in {emb_dir}"
        self.reason: str | None = None  # what is wrong, naming the file
        self.keys: list[str] = []
        try:
            self._load(emb_dir, url, expected, index, tids)
        except ValueError as e:  # _load / load_npy: the file and what is wrong with it
            self.reason = str(e)
        except (OSError, UnicodeDecodeError) as e:  # the keys file
            self.reason = f"{self.name + KEYS} unreadable ({e.__class__.__name__}: {e})"
        if self.reason and self.name not in warned:
            warned.add(self.name)
            log.warning("%s: %s; the shard's %d sample(s) count as missing_teacher (run `python -m data_tools "
                        "embed --image-model` again)", self.where, self.reason, expected)

    def _load(self, emb_dir: str, url: str, expected: int, index: dict[str, Any], tids: list[str]) -> None:
        k = int(index["augmentations"]["count"])
        with open_url(join(emb_dir, self.name + KEYS), self.remote) as f:
            keys = f.read().decode("utf-8").splitlines()
        crops = _load(emb_dir, self.name + CROPS, "iu", self.remote)
        counts = _load(emb_dir, self.name + COUNTS, "iu", self.remote)
        if len(keys) != expected or crops.shape != (expected, 1 + k, 4) or counts.shape != (expected,):
            self.reason = (f"{len(keys)} keys, crops of shape {crops.shape} and {counts.shape[0]} caption counts for "
                           f"a shard of {expected} samples at K = {k}")
            return
        if (counts < 0).any():
            self.reason = f"{self.name + COUNTS} holds negative caption counts"
            return
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        images, texts, extras = [], [], []
        nbytes = shard_bytes(url, self.remote)
        for tid in tids:
            block = index["teachers"][tid]
            record = block["shards"].get(self.name)
            if not isinstance(record, dict):
                self.reason = f"{TEACHERS} has no record of {self.name} for teacher {tid}"
                return
            if record.get("count") != expected or (keys and record.get("first_key") != keys[0]):
                self.reason = f"teacher {tid} embedded {record.get('count')} samples, the shard holds {expected}"
                return
            if nbytes is not None and record.get("bytes") is not None and nbytes != record["bytes"]:
                self.reason = f"the shard has {nbytes} bytes, {record['bytes']} when it was embedded: it was rebuilt"
                return
            image, text, extra = (_load(emb_dir, self.name + s, remote=self.remote) for s in teacher_files(tid))
            e = int(block["dim"])
            if image.shape != (expected, 1 + k, e) or text.shape != (expected, e) or extra.shape != (offsets[-1], e):
                self.reason = (f"teacher {tid}'s rows of shapes {image.shape}, {text.shape}, {extra.shape}; "
                               f"{TEACHERS} says ({expected}, {1 + k}, {e}), ({expected}, {e}), ({offsets[-1]}, {e})")
                return
            images.append(image)
            texts.append(text)
            extras.append(extra)
        self.keys, self.crops, self.offsets = keys, crops, offsets
        self.images, self.texts, self.extras = images, texts, extras

    def rows(self, pos: int, key: str) -> TeacherRows | None:
        if self.reason or pos >= len(self.keys) or self.keys[pos] != key:
            return None
        a, b = self.offsets[pos], self.offsets[pos + 1]
        return TeacherRows(self.crops[pos], np.concatenate([m[pos] for m in self.images], -1),
                           np.concatenate([m[pos] for m in self.texts], -1),
                           np.concatenate([m[a:b] for m in self.extras], -1))


class SourceTeachers:
    """A source's teacher folder: ``for_shard(url, expected)`` gives the shard's checked rows."""

    def __init__(self, emb_dir: str, index: dict[str, Any], tids: list[str], remote: RemoteConfig | None = None):
        self.emb_dir, self.index, self.tids, self.remote = emb_dir, index, tids, remote
        self.count = int(index["augmentations"]["count"])
        self.dims = [int(index["teachers"][t]["dim"]) for t in tids]
        self.warned: set[str] = set()

    def for_shard(self, url: str, expected: int) -> ShardTeachers:
        return ShardTeachers(self.emb_dir, url, expected, self.index, self.tids, self.warned, self.remote)


def attach_teachers(sources: list, spec: str | None) -> list[int]:
    """Give each source its teachers (every teacher its ``teachers.json`` records, in its order): in the
    ``data.embeddings`` folder of the source, else beside its shards. Returns the members' dimensions;
    raises ValueError naming the fix when a source has none, or the sources differ."""
    dirs = [d.strip() for d in spec.split("::")] if spec else [""] * len(sources)
    seen = None
    for source, d in zip(sources, dirs):
        emb_dir = d or posixpath.dirname(shard_path(source.urls[0])) or "."
        index = read_teachers(emb_dir, source.remote)
        problem = teachers_problem(emb_dir, remote=source.remote) if index is None else None
        if problem:
            raise ValueError(f"data.train source {source.spec}: {problem}")
        if index is None or not index["teachers"]:
            raise ValueError(f"data.train source {source.spec}: the objective distills from a teacher, but {emb_dir} "
                             f"holds no {TEACHERS}: embed the shards with one (`python -m data_tools embed "
                             f"{source.spec} --image-model MODEL --augmentations K`), or point data.embeddings at "
                             "the folder it wrote")
        if index["augmentations"].get("count", 0) < 1:
            raise ValueError(f"{join(emb_dir, TEACHERS)}: the teachers saw no training crop (--augmentations 0): "
                             "embed again with --augmentations K (K >= 1) to train on their crops")
        tids = list(index["teachers"])
        members = [(index["teachers"][t]["model"], index["teachers"][t]["dim"]) for t in tids]
        if seen is not None and members != seen:
            raise ValueError(f"data.train: the sources' teachers differ ({seen} vs {members}): embed every source "
                             "with the same --image-model list")
        seen = members
        source.teachers = SourceTeachers(emb_dir, index, tids, source.remote)
    return [d for _, d in seen or []]
