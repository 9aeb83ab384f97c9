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

from mmpretrain.data import naflex as nf
from mmpretrain.data.sources import Source

MODES = ("epoch", "resampled")
# the reader layout's version, part of a saved position's identity: 2 = workers' shares of a rank's steps
# per epoch (at most one global batch dropped); positions of layout 1 (whole batches per reader) are refused
LAYOUT = 2


@dataclass(frozen=True)
class Segment:
    shard: int  # index into the flat shard list
    start: int  # first sample index inside the shard (with data.keep: among its kept samples)
    stop: int


@dataclass(frozen=True)
class Shard:
    """One shard as the stream reads it, built once from its source (:func:`shards_of`)."""

    url: str
    offset: int  # the global index of its first sample (shards in data.train order)
    size: int  # samples read: its count in sizes.json, or its kept samples with data.keep
    full_size: int  # its count in sizes.json (sample positions run over these)
    embeddings: Any = None  # its source's SourceEmbeddings (mmpretrain.data.sidecar), None: none beside it
    teachers: Any = None  # its source's SourceTeachers (mmpretrain.data.teacher), None: no teacher read
    keep: Any = None  # data.keep: its ShardKeep (mmpretrain.data.keep; kept positions), None: every sample
    remote: Any = None  # its source's data.remote (mmpretrain.config.base.RemoteConfig): how it is opened


def shards_of(sources: list[Source]) -> list[Shard]:
    """Every source's shards in order, each with its global offset: sample ``i`` of a shard (its position
    in the shard, also with a keep-list, so an index names the same sample filtered or not) has the
    global index ``offset + i``."""
    out, offset = [], 0
    for s in sources:
        for i, url in enumerate(s.urls):
            full = s.shard_counts[i]
            out.append(Shard(url, offset, s.sizes[i], full, s.embeddings, s.teachers, s.keep[i] if s.keep else None,
                             s.remote))
            offset += full
    return out


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
    # data.naflex: (sequence lengths, patches per rank per step); a step's batch size is the budget's at the
    # step's length (mmpretrain.data.naflex); batch_size is then the largest
    naflex: tuple[tuple[int, ...], int] | None = None

    def __post_init__(self):
        self.shards = shards_of(self.sources)
        self.readers = self.world_size * self.workers
        # every rank takes `steps` batches an epoch; its batch n comes from worker n % workers (the
        # DataLoader's round robin), so a worker's share of an epoch is a whole number of batches that
        # may differ by one between workers and epochs: at most one global batch is left over
        if self.naflex is not None:
            lens, budget = self.naflex
            self.naflex = (tuple(lens), budget)
            self.sizes = nf.batch_sizes(lens, budget)
            self.batch_size = max(self.sizes)
            self.steps = nf.steps_per_epoch(lens, budget, self.num_samples, self.world_size)
        else:
            self.steps = self.num_samples // (self.world_size * self.batch_size)
        if self.steps == 0:
            what = ("data.naflex.max_tokens_per_batch" if self.naflex else "data.batch_size")
            raise ValueError(
                f"{self.num_samples} samples per epoch cannot fill one batch of {self.batch_size} on each of "
                f"{self.world_size} rank(s); lower {what}"
            )
        self._batches: dict[int, list[tuple[int, int]]] = {}

    def step_batches(self, epoch: int) -> list[tuple[int, int]]:
        """``(samples per rank, sequence length or 0)`` of each of the epoch's ``steps`` steps."""
        if epoch not in self._batches:
            if self.naflex is None:
                self._batches = {epoch: [(self.batch_size, 0)] * self.steps}
            else:
                lens = self.naflex[0]
                self._batches = {epoch: [(self.sizes[i], lens[i]) for i in
                                         nf.step_lengths(lens, self.seed, epoch, self.steps)]}
        return self._batches[epoch]

    def worker_steps(self, epoch: int, worker: int) -> list[tuple[int, int]]:
        """The ``(size, length)`` of the batches worker ``worker`` makes in ``epoch``, in order."""
        first = epoch * self.steps
        return [b for n, b in enumerate(self.step_batches(epoch)) if (first + n) % self.workers == worker]

    @property
    def rank_samples(self) -> int:
        """Samples one rank trains on per epoch."""
        return self.steps * self.batch_size if self.naflex is None else sum(b for b, _ in self.step_batches(0))

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.shards]

    @property
    def steps_per_epoch(self) -> int:
        return self.steps

    @property
    def dropped_per_epoch(self) -> int:
        return self.num_samples - self.world_size * self.rank_samples if self.mode == "epoch" else 0

    def worker_batches(self, epoch: int, worker: int) -> int:
        """How many of a rank's ``steps`` batches of ``epoch`` worker ``worker`` makes: the rank's batches
        ``n`` in ``[epoch * steps, (epoch + 1) * steps)`` with ``n % workers == worker``."""
        S, W = self.steps, self.workers
        return ((epoch + 1) * S - 1 - worker) // W - (epoch * S - 1 - worker) // W

    def reader_length(self, epoch: int, worker: int) -> int:
        """Samples a reader (of any rank) emits in ``epoch``."""
        if self.naflex is not None:
            return sum(b for b, _ in self.worker_steps(epoch, worker))
        return self.worker_batches(epoch, worker) * self.batch_size

    def first_worker(self, epoch: int) -> int:
        """The worker whose batch opens ``epoch`` on every rank."""
        return (epoch * self.steps) % self.workers

    def identity(self) -> dict[str, Any]:
        """What a saved position is only valid for."""
        kept = [(s.keep_record or {}).get("digest") for s in self.sources]
        digest = hashlib.sha1(json_bytes([self.urls, [s.size for s in self.shards], [s.weight for s in self.sources]]
                                         + ([kept] if any(kept) else []))).hexdigest()
        return {"layout": LAYOUT, "mode": self.mode, "seed": self.seed, "world_size": self.world_size, "workers": self.workers,
                "batch_size": self.batch_size, "num_samples": self.num_samples,
                "shuffle_block": self.shuffle_block, "data": digest[:16],
                **({"naflex": [list(self.naflex[0]), self.naflex[1]]} if self.naflex else {})}

    def shard_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.shards)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def _slice(self, order: list[int], a: int, b: int) -> list[Segment]:
        """Segments covering positions ``[a, b)`` of the concatenation of ``order``'s shards."""
        out, pos = [], 0
        for shard in order:
            n = self.shards[shard].size
            lo, hi = max(a, pos), min(b, pos + n)
            if lo < hi:
                out.append(Segment(shard, lo - pos, hi - pos))
            pos += n
            if pos >= b:
                break
        return out

    def _start(self, epoch: int, reader: int) -> int:
        """Where a reader's main range starts in the epoch's order."""
        rank, worker = divmod(reader, self.workers)
        return rank * self.rank_samples + sum(self.reader_length(epoch, w) for w in range(worker))

    def reader_layout(self, epoch: int, reader: int) -> tuple[list[Segment], list[Segment]]:
        """Epoch mode: (main range, spares) of a reader. Main ranges tile ``[0, ranks * steps * batch)``
        of the epoch's order in reader order (rank, then worker); the remainder after them is split
        equally between the readers as spares."""
        order = self.shard_order(epoch)
        start = self._start(epoch, reader)
        main = self._slice(order, start, start + self.reader_length(epoch, reader % self.workers))
        used = self.world_size * self.rank_samples
        each = (self.num_samples - used) // self.readers
        first = used + reader * each
        return main, self._slice(order, first, first + each)

    def fill_segments(self, epoch: int, reader: int) -> list[Segment]:
        """Epoch mode: what a reader reads after its range and spares when bad samples left it short: the
        whole epoch's order from its own range's start, wrapping around (its own range first, then the
        ranges after it): each of the :attr:`total` positions once."""
        order, start = self.shard_order(epoch), self._start(epoch, reader)
        return self._slice(order, start, self.total) + self._slice(order, 0, start)

    @property
    def total(self) -> int:
        """Samples in one pass over every shard (kept ones with data.keep)."""
        return sum(s.size for s in self.shards)

    def drawn_segments(self, epoch: int, reader: int) -> Iterator[Segment]:
        """Resampled mode: whole shards drawn with replacement, without end."""
        rng = random.Random(f"{self.seed}:{epoch}:draw:{reader}")
        weights = [s.weight for s in self.sources]
        offsets = np.cumsum([0] + [len(s.urls) for s in self.sources]).tolist()
        while True:
            src = rng.choices(range(len(self.sources)), weights=weights)[0]
            shard = offsets[src] + rng.randrange(len(self.sources[src].urls))
            yield Segment(shard, 0, self.shards[shard].size)


def json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True).encode()
