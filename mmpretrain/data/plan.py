"""The stream's plan: which shard segments each reader reads in each epoch. No I/O.

Everything here is a pure function of the sources' shard lists and counts, the seed, the epoch and
the reader (``rank * workers + worker``); :mod:`mmpretrain.data.stream` explains the rules (epoch
and resampled modes, the dropped remainder, the spares) and executes the plan.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmpretrain.data.sources import Source

MODES = ("epoch", "resampled")


@dataclass(frozen=True)
class Segment:
    shard: int  # index into the flat shard list
    start: int  # first sample index inside the shard
    stop: int


@dataclass
class StreamPlan:
    """Everything the stream is a function of (besides the epoch and position)."""

    sources: list[Source]
    mode: str
    seed: int
    world_size: int
    workers: int  # readers per rank (DataLoader workers, at least 1)
    batch_size: int
    num_samples: int  # per epoch: the dataset (epoch mode) or the budget (resampled)
    shuffle_block: int

    def __post_init__(self):
        self.urls = [u for s in self.sources for u in s.urls]
        self.sizes = [n for s in self.sources for n in s.sizes]
        # each shard's sidecar embeddings (mmpretrain.data.sidecar.SourceEmbeddings), None: none beside it
        self.embeddings = [s.embeddings for s in self.sources for _ in s.urls]
        # the global index of sample i of shard k is offsets[k] + i (shards in data.train order)
        self.offsets = np.cumsum([0] + self.sizes[:-1]).tolist() if self.sizes else []
        self.readers = self.world_size * self.workers
        self.per_reader = (self.num_samples // (self.readers * self.batch_size)) * self.batch_size
        if self.per_reader == 0:
            raise ValueError(
                f"{self.num_samples} samples per epoch cannot fill one batch of {self.batch_size} on each of "
                f"{self.world_size} rank(s) x {self.workers} worker(s); lower data.batch_size or data.num_workers"
            )

    @property
    def steps_per_epoch(self) -> int:
        return self.workers * self.per_reader // self.batch_size

    @property
    def dropped_per_epoch(self) -> int:
        return self.num_samples - self.readers * self.per_reader if self.mode == "epoch" else 0

    def identity(self) -> dict[str, Any]:
        """What a saved position is only valid for."""
        digest = hashlib.sha1(json_bytes([self.urls, self.sizes, [s.weight for s in self.sources]])).hexdigest()
        return {"mode": self.mode, "seed": self.seed, "world_size": self.world_size, "workers": self.workers,
                "batch_size": self.batch_size, "num_samples": self.num_samples,
                "shuffle_block": self.shuffle_block, "data": digest[:16]}

    def shard_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.urls)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def _slice(self, order: list[int], a: int, b: int) -> list[Segment]:
        """Segments covering positions ``[a, b)`` of the concatenation of ``order``'s shards."""
        out, pos = [], 0
        for shard in order:
            n = self.sizes[shard]
            lo, hi = max(a, pos), min(b, pos + n)
            if lo < hi:
                out.append(Segment(shard, lo - pos, hi - pos))
            pos += n
            if pos >= b:
                break
        return out

    def reader_layout(self, epoch: int, reader: int) -> tuple[list[Segment], list[Segment]]:
        """Epoch mode: (main range, spares) of a reader."""
        order = self.shard_order(epoch)
        L = self.per_reader
        main = self._slice(order, reader * L, (reader + 1) * L)
        tail = self.num_samples - self.readers * L
        each = tail // self.readers
        start = self.readers * L + reader * each
        return main, self._slice(order, start, start + each)

    def drawn_segments(self, epoch: int, reader: int) -> Iterator[Segment]:
        """Resampled mode: whole shards drawn with replacement, without end."""
        rng = random.Random(f"{self.seed}:{epoch}:draw:{reader}")
        weights = [s.weight for s in self.sources]
        offsets = np.cumsum([0] + [len(s.urls) for s in self.sources]).tolist()
        while True:
            src = rng.choices(range(len(self.sources)), weights=weights)[0]
            shard = offsets[src] + rng.randrange(len(self.sources[src].urls))
            yield Segment(shard, 0, self.sizes[shard])


def json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True).encode()
