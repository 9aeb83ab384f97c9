"""One reader's samples for one epoch (:class:`Reader`): its range of the plan, shuffled in blocks, then
its spares and the fill after bad samples, decoded, each with the cursor after it; the rules are
:mod:`mmpretrain.data.stream`'s. :class:`StreamError` when no usable sample is left."""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Iterator
from typing import Any

from mmpretrain.data import urls
from mmpretrain.data.decode import SampleDecoder, SkipSample
from mmpretrain.data.plan import StreamPlan
from mmpretrain.data.segments import SegmentReader

log = logging.getLogger("mmpretrain.data.stream")


class StreamError(RuntimeError):
    """The stream cannot go on (a reader has no readable sample left): the trainer reports it in one
    line and exits 1. (No ``message`` attribute: torch's DataLoader would then re-raise it from a worker
    as ``StreamError(message=...)``.)"""

    @staticmethod
    def line_of(e: BaseException) -> str:
        """The error's own line (a DataLoader worker re-raises it with the worker's traceback around it)."""
        last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
        return last.split("StreamError: ", 1)[-1]


class Reader:
    """One reader's samples for one epoch, from a cursor ``[epoch, block_start, consumed, emitted]``."""

    def __init__(self, plan: StreamPlan, decoder: SampleDecoder, rank: int, worker: int):
        self.plan, self.decoder, self.rank, self.worker = plan, decoder, rank, worker
        self.index = rank * plan.workers + worker

    def epoch(self, cursor: list[int], skipped: Counter) -> Iterator[tuple[dict[str, Any], list[int]]]:
        plan = self.plan
        epoch, pos, k0, emitted = cursor
        L, S = plan.reader_length(epoch, self.worker), max(1, plan.shuffle_block)
        if plan.mode == "epoch":
            main, spare = plan.reader_layout(epoch, self.index)
            fill = plan.fill_segments(epoch, self.index)
            M = sum(s.stop - s.start for s in main)
            P = sum(s.stop - s.start for s in spare)
            N = plan.total
            limit = M + P + N  # that many failed slots in a row have tried every position of the epoch

            def segments():
                yield from main
                yield from spare
                while True:  # only to fill after bad samples: the epoch from this reader's range on, round
                    yield from fill
        else:
            M, P, N, limit = None, 0, 0, 10 * L + 10_000
            segments = lambda: plan.drawn_segments(epoch, self.index)  # noqa: E731
        reader = SegmentReader(plan.shards, segments())
        bad: dict[int, set[str]] = {}  # shard -> why samples of it were not used, this epoch
        fruitless, borrowing = 0, False
        while emitted < L:
            if M is None or pos < M:  # shuffled blocks (never crossing into the spares)
                end = pos + S if M is None else min(pos + S, M)
                perm = list(range(pos, end))
                if plan.shuffle_block > 1:
                    random.Random(f"{plan.seed}:{epoch}:{self.rank}:{self.worker}:{pos // S}").shuffle(perm)
                at = None
            else:  # spares, then the fill: in order
                end = pos + 1
                perm = [pos]
                at = (pos - M - P) % N if pos >= M + P else None  # where in the fill (own range first)
            # only the slots not consumed yet are read (a resumed block skips the rest without extracting)
            raws = {p: (reader.get(p), reader.last_shard) for p in sorted(perm[k0:])}
            retries = urls.take_retries()  # remote reads retried (no sample lost): counted with the skips
            if retries:
                skipped["remote_retries"] += retries
            if reader.uncounted:
                skipped["beyond_sizes_json"] += reader.uncounted
                reader.uncounted = 0
            for j in range(k0, len(perm)):
                raw, shard = raws[perm[j]]
                # a bad sample met again while filling was counted in the first pass of this epoch (by
                # this reader or the one whose range it is)
                reason = raw if isinstance(raw, str) else None
                if reason is None:
                    try:
                        # a batch's first image is decoded here also with data.decode=device (its anchor)
                        item = self.decoder(raw, plan.seed, epoch, emitted % plan.batch_size == 0)
                    except SkipSample as e:
                        reason = e.reason
                if reason is not None:
                    fruitless += 1
                    skipped[reason] += at is None
                    bad.setdefault(shard, set()).add(reason)
                    continue
                item["index"] = raw["__index__"]
                if at is not None:
                    own = at < M
                    skipped["repeated_to_fill" if own else "borrowed_to_fill"] += 1
                    if not own and not borrowing:
                        borrowing = True
                        log.warning("reader %d (rank %d, worker %d): its share of epoch %d has too few decodable "
                                    "samples; it fills its batches from the ranges after it (counted as "
                                    "borrowed_to_fill)", self.index, self.rank, self.worker, epoch)
                emitted += 1
                fruitless = 0
                yield item, [epoch, pos, j + 1, emitted]
                if emitted == L:
                    return
            if fruitless >= limit:
                raise StreamError(self._nothing_left(epoch, bad))
            pos, k0 = end, 0

    def _nothing_left(self, epoch: int, bad: dict[int, set[str]]) -> str:
        """The line that ends the run: every position of the epoch (epoch mode) or many draws (resampled)
        gave no usable sample; every shard that gave a bad one, with why."""
        dead = {"unreadable_shard", "missing_in_shard"}
        unreadable = sorted(self.plan.shards[k].url for k, why in bad.items() if why & dead)
        skipping = sorted(f"{self.plan.shards[k].url} ({', '.join(sorted(why))})" for k, why in bad.items() if not why & dead)
        parts = [f"{what}: {', '.join(names[:20])}" + (f" and {len(names) - 20} more" if len(names) > 20 else "")
                 for what, names in (("unreadable shard(s)", unreadable),
                                     ("shard(s) whose samples were all skipped", skipping)) if names]
        where = ("any shard of the data" if self.plan.mode == "epoch"
                 else f"{10 * self.plan.reader_length(epoch, self.worker) + 10_000} samples of drawn shards")
        return (f"no decodable sample left in epoch {epoch}: reader {self.index} (rank {self.rank}, worker "
                f"{self.worker}) found none in {where}" + "".join(f"; {p}" for p in parts)
                + ". Check the data: python -m data_tools verify")
