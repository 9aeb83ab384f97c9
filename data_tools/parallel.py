"""Parallel, resumable shard building: one source chunk -> one shard, in a process pool and across
ranks under ``accelerate launch``.

A chunk's shard is written as ``NAME.tmp`` and renamed once complete, after its stats file
``.build/NAME.json`` (count and skips by reason); a re-run skips every chunk whose shard and stats
both exist, so an interrupted build finishes the missing shards and leaves complete ones untouched.
Rank 0 merges the stats into ``sizes.json`` and ``manifest.json`` when every rank is done.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import webdataset as wds

from data_tools import __version__
from data_tools.images import BadImage, encode, prepare
from data_tools.sources.records import DUPLICATE_KEY, decode_caption, decode_image
from mmpretrain.data.manifest import MANIFEST, SIZES, write_json_atomic
from mmpretrain.data.workers import start_method, worker_init
from mmpretrain.process import current_process

STATS_DIR = ".build"


def _stats_path(out: Path, name: str) -> Path:
    return out / STATS_DIR / (name + ".json")


def chunk_done(out: Path, name: str) -> bool:
    """Complete = its stats file exists and every shard part it lists is in place."""
    p = _stats_path(out, name)
    return p.is_file() and all((out / part).is_file() for part in json.loads(p.read_text())["parts"])


class _PartWriter:
    """Writes one chunk as ``NAME`` (and ``NAME-stem_{p:02d}.tar`` parts past the byte limit), each
    through a ``.tmp`` file."""

    def __init__(self, out: Path, name: str, max_bytes: float):
        self.out, self.stem, self.max_bytes = out, name[: -len(".tar")], max_bytes
        self.parts: dict[str, int] = {}
        self.writer = None
        self.size = 0

    def _open(self):
        p = len(self.parts)
        name = f"{self.stem}.tar" if p == 0 else f"{self.stem}_{p:02d}.tar"
        self.parts[name] = 0
        self.writer = wds.TarWriter(str(self.out / (name + ".tmp")), encoder=False)
        self.size = 0

    def write(self, sample: dict) -> None:
        if self.writer is None or self.size >= self.max_bytes:
            self.close()
            self._open()
        self.size += self.writer.write(sample)
        self.parts[list(self.parts)[-1]] += 1

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def commit(self) -> None:
        self.close()
        for name in self.parts:
            os.replace(self.out / (name + ".tmp"), self.out / name)


def write_chunk(task: tuple) -> dict[str, Any]:
    """Worker: read one chunk of the source, normalise every sample, write one shard."""
    source, chunk, out, name, opts, skip_keys = task
    out = Path(out)
    skipped: Counter = Counter()
    seen: set[str] = set()
    count = 0
    w = _PartWriter(out, name, opts["shard_bytes"])
    for rec in source.read_chunk(chunk):
        if rec.error:
            skipped[rec.error] += 1
            continue
        if rec.key in seen or rec.key in skip_keys:
            skipped[DUPLICATE_KEY] += 1
            continue
        seen.add(rec.key)
        try:
            caption = decode_caption(rec.caption)
            img = prepare(decode_image(rec.image, opts["max_pixels"]), opts["image_size"], opts["max_pixels"])
            data = encode(img, opts["image_format"], opts["quality"])
        except BadImage as e:
            skipped[e.reason] += 1
            continue
        meta = dict(rec.meta, width=img.width, height=img.height)
        w.write({"__key__": rec.key, opts["image_format"]: data, "txt": caption.encode("utf-8"),
                 "json": json.dumps(meta, ensure_ascii=False, default=str).encode("utf-8")})
        count += 1
    w.close()
    stats = {"count": count, "skipped": dict(skipped), "parts": w.parts}
    # stats first, then the renames: a crash in between leaves parts missing, so the chunk is redone
    write_json_atomic(_stats_path(out, name), stats)
    w.commit()
    return {"name": name, **stats}


def _duplicates(source, chunks: list, names: list[str]) -> dict[str, set[str]]:
    """Keys that appeared in an earlier chunk, per chunk (the first occurrence is kept; repeats
    within a chunk are caught while it is written)."""
    per: dict[str, set[str]] = {n: set() for n in names}
    first: dict[str, int] = {}
    for c, (keys, name) in enumerate(zip(source.keys_by_chunk(chunks), names)):
        for k in keys:
            if first.setdefault(k, c) != c:
                per[name].add(k)
    return per


def build_parallel(source, out: str | Path, *, prefix: str, shard_size: int, workers: int, opts: dict,
                   manifest: dict) -> dict[str, Any]:
    out = Path(out)
    (out / STATS_DIR).mkdir(parents=True, exist_ok=True)
    chunks = source.chunks(shard_size)
    names = [f"{prefix}-{k:06d}.tar" for k in range(len(chunks))]
    proc = current_process()
    rank, world = proc.rank, proc.world_size
    dups = _duplicates(source, chunks, names)
    tasks = [(source, chunks[k], str(out), names[k], opts, dups[names[k]])
             for k in range(len(chunks)) if k % world == rank and not chunk_done(out, names[k])]
    mine = {t[3][: -len(".tar")] for t in tasks}
    for stale in out.glob(f"{prefix}-*.tar.tmp"):  # half-written by an interrupted run: redone below
        if stale.name.split("_")[0].removesuffix(".tar.tmp") in mine:
            stale.unlink()
    if workers > 1 and len(tasks) > 1:
        with get_context(start_method(write_chunk, tasks)).Pool(min(workers, len(tasks)), worker_init()) as pool:
            for _ in pool.imap_unordered(write_chunk, tasks):
                pass
    else:
        for t in tasks:
            write_chunk(t)
    proc.barrier()
    summary = {"chunks": len(chunks), "written_now": len(tasks)}
    if rank == 0:
        sizes, skipped = {}, Counter()
        for name in names:
            stats = json.loads(_stats_path(out, name).read_text())
            skipped.update(stats["skipped"])
            sizes.update({part: n for part, n in stats["parts"].items() if n})
        write_json_atomic(out / SIZES, sizes)
        man = dict(manifest)
        man.update({"tool": "data_tools", "tool_version": __version__,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "counts": {"samples": sum(sizes.values()), "shards": len(sizes)},
                    "skipped": dict(skipped), "image_format": opts["image_format"],
                    "image_size": opts["image_size"]})
        write_json_atomic(out / MANIFEST, man)
        summary.update(samples=sum(sizes.values()), shards=len(sizes), skipped=dict(skipped))
    proc.barrier()
    return summary
