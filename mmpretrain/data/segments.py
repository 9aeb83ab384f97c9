"""Raw samples at positions of a reader's shard segments (:mod:`mmpretrain.data.plan`), read through
:mod:`mmpretrain.data.tar` with each shard's sidecar rows, teacher rows and keep-list; the training
stream (:mod:`mmpretrain.data.stream`) decodes and batches them."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from mmpretrain.data.plan import Segment, Shard
from mmpretrain.data.tar import UNREADABLE, read_tar

log = logging.getLogger("mmpretrain.data.stream")


class SegmentReader:
    """Raw samples at increasing positions of a reader's segments, each with its global sample index as
    ``__index__``; an unreadable position comes back as the reason string. Shards whose reading failed:
    ``failed_shards``; samples beyond a shard's ``sizes.json`` count (never read): ``uncounted``."""

    def __init__(self, shards: list[Shard], segments: Iterator[Segment]):
        self.shards, self.segments, self.key_warned = shards, segments, set()
        self.shard_teacher: tuple[int, Any] | None = None
        self.shard_emb: tuple[int, Any] | None = None  # (shard, ShardEmbeddings) of the shard last opened
        self.seg: Segment | None = None
        self.seg_pos = 0  # position of self.seg's first sample
        self.it: Iterator[dict[str, Any]] | None = None
        self.next_in_shard = 0  # the shard position of the sample self.it yields next
        self.failed: str | None = None
        self.failed_shards, self.uncounted = set(), 0
        self.tails_checked: set[int] = set()  # each shard's surplus counted once per epoch
        self.last_shard = -1  # the shard of the position last read

    def _advance_to(self, pos: int) -> None:
        while self.seg is None or pos >= self.seg_pos + (self.seg.stop - self.seg.start):
            if self.seg is not None:
                self.seg_pos += self.seg.stop - self.seg.start
            self.seg = next(self.segments)
            self.it, self.next_in_shard, self.failed = None, 0, None

    def _check_tail(self) -> None:
        """A segment read to its shard's counted end: samples after it are beyond sizes.json."""
        seg = self.seg
        if (self.it is None or self.failed or seg.stop != self.shards[seg.shard].size
                or self.next_in_shard != self.shards[seg.shard].full_size or seg.shard in self.tails_checked):
            return
        self.tails_checked.add(seg.shard)
        try:
            extra = sum(1 for _ in self.it)
        except UNREADABLE:
            extra = 0
        if extra:
            log.warning("shard %s holds %d sample(s) beyond its sizes.json count %d: they are never read; "
                        "rebuild sizes.json (python -m data_tools verify)", self.shards[seg.shard].url, extra,
                        self.shards[seg.shard].full_size)
            self.uncounted += extra

    def _sidecar(self, k: int):
        if self.shard_emb is None or self.shard_emb[0] != k:
            shard = self.shards[k]
            self.shard_emb = (k, shard.embeddings.for_shard(shard.url, shard.full_size))
        return self.shard_emb[1]

    def _teacher(self, k: int):
        if self.shard_teacher is None or self.shard_teacher[0] != k:
            shard = self.shards[k]
            self.shard_teacher = (k, shard.teachers.for_shard(shard.url, shard.full_size))
        return self.shard_teacher[1]

    def get(self, pos: int) -> dict[str, Any] | str:
        self._advance_to(pos)
        seg = self.seg
        self.last_shard = seg.shard
        local = seg.start + pos - self.seg_pos  # among the shard's samples read (its kept ones with data.keep)
        shard = self.shards[seg.shard]
        keep = shard.keep
        at = int(keep.positions[local]) if keep is not None else local  # the shard position
        if self.failed:
            return self.failed
        if self.it is None or at < self.next_in_shard:
            self.it = read_tar(shard.url, skip=at, remote=shard.remote)
            self.next_in_shard = at
        try:
            while self.next_in_shard < at:  # skip without decoding
                next(self.it)
                self.next_in_shard += 1
            raw = next(self.it)
            self.next_in_shard += 1
            if keep is not None and (want := keep.key(local)) is not None and raw["__key__"] != want:
                if seg.shard not in self.key_warned and not self.key_warned.add(seg.shard):
                    log.warning("shard %s: sample %d is %r, the keep-list says %r: the shard changed after "
                                "filtering (its other mismatches are counted as keep_key_mismatch); run `python -m "
                                "data_tools filter` again", shard.url, at, raw["__key__"], want)
                return "keep_key_mismatch"
            raw["__index__"] = shard.offset + at
            if shard.embeddings is not None:
                side = self._sidecar(seg.shard)
                raw["__emb__"] = side.row(at, raw["__key__"])
                raw["__emb_extra__"] = side.extra(at) if raw["__emb__"] is not None else None
            if shard.teachers is not None:
                raw["__teacher__"] = self._teacher(seg.shard).rows(at, raw["__key__"])
            self._check_tail()
            return raw
        except StopIteration:
            self.failed = "missing_in_shard"  # fewer samples than sizes.json says
        except UNREADABLE as e:
            if shard.url not in self.failed_shards:  # said once per reader
                log.warning("shard %s unreadable at sample %d: %s", shard.url, at, e)
            self.failed = "unreadable_shard"
        self.failed_shards.add(shard.url)
        return self.failed
