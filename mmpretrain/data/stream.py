"""The training stream: a pure function of ``(seed, epoch, position)``.

**Readers.** A rank with ``W`` DataLoader workers runs ``W`` readers (one with 0 workers); reader
``k = rank * W + worker`` of ``R * W``. The DataLoader takes batches from its workers in turn, so the
rank's batch ``n`` comes from worker ``n % W``.

**Epoch mode** (``data.mode=epoch``). Each epoch the shards of all sources are put in an order seeded
by ``(seed, epoch)`` and their samples concatenated (``N`` positions). Every rank takes
``S = floor(N / (R*B))`` steps per epoch; the rank's batch ``n`` comes from worker ``n % W``, so
worker ``w`` makes the batches ``n`` of ``[e*S, (e+1)*S)`` with ``n % W == w`` (whole batches; the
counts of two workers differ by at most one). The sequence is cut into ``R * W`` contiguous ranges of
those lengths, in node-then-worker order, so each reader opens only the shards its range touches
(with at least as many shards as readers, at most two readers share a shard). Fewer shards than
readers (CC3M's ~330 img2dataset shards for 64 GPUs x 8 workers) split a shard between readers, each
skipping to its range (local files seek past the members before it; remote ones are streamed to it).
Every rank therefore takes ``S`` steps per epoch and sees every sample of its ranges exactly once; the
``N - R*S*B < R*B`` samples at the end -- less than one global batch -- are the dropped remainder
(logged as ``dropped_remainder`` in ``skipped``). Each reader also owns an equal slice of that remainder as
spares: a reader whose range holds bad samples fills its last batch from its spares (still
"exactly once": spares are otherwise dropped); if they run out it reads on through the epoch's order
from its range's start, wrapping around (:meth:`~mmpretrain.data.plan.StreamPlan.fill_segments`): its
own range again (counted as ``repeated_to_fill``), then the ranges after it (``borrowed_to_fill``), because
every rank must take the same number of equal-sized steps. So a reader whose whole range lies in an
unreadable shard (readers outnumber shards at scale) trains on from good data, by a rule a resume
replays; a bad sample met again while filling is not counted twice. The stream stops
(:class:`StreamError`) only after a reader has tried every position of the epoch in a row without a
usable sample, naming every shard that gave it a bad one.

**Resampled mode** (``data.mode=resampled``). Reader ``k`` draws shards with replacement, a source
by ``data.weights`` then a shard uniformly, from a generator seeded by ``(seed, epoch, k)``. An epoch
is the sample budget ``data.num_samples`` (default: the dataset's size), split between readers as above.

**Shuffle.** Within a reader, positions are shuffled in blocks of ``data.shuffle_buffer`` samples, the
permutation of block ``b`` seeded by ``(seed, epoch, rank, worker, b)``: raw bytes are permuted and
only emitted samples are decoded. Random augmentation of a sample is seeded by
``(seed, epoch, sample key)``, so it does not depend on which worker or rank decodes it.

**Position and resume.** Every batch carries its reader's cursor after it: ``[epoch, block start,
slots of the block consumed, samples emitted this epoch]``. :class:`StreamPosition` keeps the last
cursor of each reader and the rank's batch count; it is JSON. Resuming from it skips whole shards
by their ``sizes.json`` counts and then samples inside a shard without decoding (or reading their
bytes into Python), and the next batch is bit-identical to the uninterrupted run's. Resume needs the
same ranks, workers, batch size, seed, mode and data; anything else is refused with the reason.

**Sample index.** Every sample carries its global index ``offset of its shard + position in the
shard`` (shards in ``data.train`` order), the same under resume, any rank count, resampling and a
keep-list; a resampled batch can hold one index twice.

**Keep-list** (``data.keep``, :mod:`mmpretrain.data.keep`). The plan counts a shard's kept samples
only (its segments are ranges of them); a reader seeks to each kept sample's stored position, passing
the others without decoding, and checks its key (a mismatch is counted as ``keep_key_mismatch``).

Kept out of ``accelerator.prepare()``: the split by rank happens here, Accelerate would split again.
The parts: :mod:`~mmpretrain.data.plan` (which segments each reader reads; no I/O),
:mod:`~mmpretrain.data.tar` (reading shards), :mod:`~mmpretrain.data.decode` (raw sample -> item);
this module executes the plan, batches, and keeps the position.
"""

from __future__ import annotations

import logging
import os
import random
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from mmpretrain.data import urls
from mmpretrain.data.decode import SampleDecoder, SkipSample
from mmpretrain.data.device_decode import jpeg_fields
from mmpretrain.data.plan import StreamPlan
from mmpretrain.data.segments import SegmentReader

log = logging.getLogger(__name__)


class StreamError(RuntimeError):
    """The stream cannot go on (a reader has no readable sample left): the trainer reports it in one
    line and exits 1. (No ``message`` attribute: torch's DataLoader would then re-raise it from a worker
    as ``StreamError(message=...)``.)"""

    @staticmethod
    def line_of(e: BaseException) -> str:
        """The error's own line (a DataLoader worker re-raises it with the worker's traceback around it)."""
        last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
        return last.split("StreamError: ", 1)[-1]


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack``; in a DataLoader worker into shared memory directly, as torch's default collate
    does (a batch stacked in private memory is copied once more into shared memory to be handed over)."""
    if get_worker_info() is None:
        return torch.stack(tensors)
    first = tensors[0]
    storage = first.untyped_storage()._new_shared(len(tensors) * first.numel() * first.element_size())
    out = first.new_empty(0).set_(storage, 0, (len(tensors), *first.shape))
    return torch.stack(tensors, out=out)


def collate(items: list[dict[str, Any]], tokenizer=None) -> dict[str, Any]:
    """A batch: ``images (B, 3, H, W)``, ``texts``, ``keys``, ``sample_index (B,)`` (global, stable under
    resume, rank count and resampling), ``tokens (B, L)`` with a tokenizer, and ``target_embeddings
    (B, E)`` / ``labels (B,)`` when every item has one; with ``data.decode=device`` the JPEG fields of
    :func:`~mmpretrain.data.device_decode.jpeg_fields` (``images`` then holds the worker-decoded images
    only: the device makes the batch's image tensor)."""
    images = [it["image"] for it in items if "image" in it]
    batch: dict[str, Any] = {
        "texts": [it["text"] for it in items],
        "keys": [it["key"] for it in items],
        "sample_index": torch.tensor([it["index"] for it in items], dtype=torch.long),
    }
    if images:
        batch["images"] = _stack(images)
    if tokenizer is not None:
        batch["tokens"] = tokenizer(batch["texts"])
    if "negative" in items[0]:  # hard_negatives: one negative caption per sample, "" (masked) where it has none
        negs = [it["negative"] for it in items]
        batch["negative_mask"] = torch.tensor([n is not None for n in negs], dtype=torch.bool)
        if tokenizer is not None:
            batch["negative_tokens"] = tokenizer([n or "" for n in negs])
    if all("emb" in it for it in items):
        batch["target_embeddings"] = _stack([it["emb"] for it in items])
    if all("teacher_image" in it for it in items):  # stored teacher rows (mmpretrain.data.teacher)
        batch["teacher_image_embeddings"] = _stack([it["teacher_image"] for it in items])
        batch["teacher_text_embeddings"] = _stack([it["teacher_text"] for it in items])
    if all("label" in it for it in items):
        batch["labels"] = torch.tensor([it["label"] for it in items], dtype=torch.long)
    batch.update(jpeg_fields(items))  # data.decode=device: the JPEGs the trainer decodes
    return batch


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
        reader = SegmentReader(plan.urls, plan.offsets, plan.sizes, segments(), plan.embeddings, plan.teachers,
                               plan.keep, plan.full_sizes)
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
        unreadable = sorted(self.plan.urls[k] for k, why in bad.items() if why & dead)
        skipping = sorted(f"{self.plan.urls[k]} ({', '.join(sorted(why))})" for k, why in bad.items() if not why & dead)
        parts = [f"{what}: {', '.join(names[:20])}" + (f" and {len(names) - 20} more" if len(names) > 20 else "")
                 for what, names in (("unreadable shard(s)", unreadable),
                                     ("shard(s) whose samples were all skipped", skipping)) if names]
        where = ("any shard of the data" if self.plan.mode == "epoch"
                 else f"{10 * self.plan.reader_length(epoch, self.worker) + 10_000} samples of drawn shards")
        return (f"no decodable sample left in epoch {epoch}: reader {self.index} (rank {self.rank}, worker "
                f"{self.worker}) found none in {where}" + "".join(f"; {p}" for p in parts)
                + ". Check the data: python -m data_tools verify")


class TrainStream(IterableDataset):
    """Endless batches of one rank (:func:`collate`'s keys, plus ``skipped`` counts, ``epoch`` -- the
    0-based stream epoch the batch belongs to --, ``worker`` and the reader's ``cursor`` after it).
    ``start``: :class:`StreamPosition` state to resume from."""

    def __init__(self, plan: StreamPlan, decoder: SampleDecoder, rank: int, tokenizer=None,
                 start: dict[str, Any] | None = None):
        super().__init__()
        self.plan, self.decoder, self.rank, self.tokenizer = plan, decoder, rank, tokenizer
        self.cursors = {w: [0, 0, 0, 0] for w in range(plan.workers)}
        self.first_worker = 0
        if start is not None:
            self.cursors = {int(w): list(c) for w, c in start["cursors"].items()}
            self.first_worker = start["batches"] % plan.workers

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        physical, n = (info.id, info.num_workers) if info else (0, 1)
        if n != self.plan.workers:
            raise RuntimeError(f"stream planned for {self.plan.workers} reader(s) per rank but run by {n} "
                               "DataLoader worker(s)")
        worker = (physical + self.first_worker) % n  # the loader starts at physical worker 0
        reader = Reader(self.plan, self.decoder, self.rank, worker)
        cursor = list(self.cursors[worker])
        B = self.plan.batch_size
        while True:
            epoch = cursor[0]
            if cursor[3] >= self.plan.reader_length(epoch, worker):  # a finished epoch: start the next
                cursor = [epoch + 1, 0, 0, 0]
                continue
            skipped: Counter = Counter()
            if cursor[3] == 0 and worker == self.plan.first_worker(epoch) and self.plan.dropped_per_epoch:
                # the remainder that no reader emits, counted once per epoch on every rank, as its share
                # of the total, by the worker whose batch opens the epoch
                share = self.plan.dropped_per_epoch // self.plan.world_size
                share += int(self.rank < self.plan.dropped_per_epoch % self.plan.world_size)
                if share:
                    skipped["dropped_remainder"] += share
            items: list[dict[str, Any]] = []
            for item, after in reader.epoch(cursor, skipped):
                items.append(item)
                if len(items) == B:
                    batch = collate(items, self.tokenizer)
                    batch.update(skipped=dict(skipped), epoch=epoch, worker=worker, cursor=list(after))
                    yield batch
                    items = []
                    skipped.clear()  # in place: the reader holds this counter
            cursor = [epoch + 1, 0, 0, 0]


class StreamPosition:
    """The rank's position: batches consumed and each reader's cursor after its last consumed batch."""

    def __init__(self, plan: StreamPlan, state: dict[str, Any] | None = None):
        self.plan = plan
        self.batches = 0
        self.cursors: dict[int, list[int]] = {w: [0, 0, 0, 0] for w in range(plan.workers)}
        if state is not None:
            self.load(state)

    def advance(self, batch: dict[str, Any]) -> None:
        self.batches += 1
        self.cursors[batch["worker"]] = list(batch["cursor"])

    def state(self) -> dict[str, Any]:
        return {"plan": self.plan.identity(), "batches": self.batches,
                "cursors": {str(w): c for w, c in self.cursors.items()}}

    def load(self, state: dict[str, Any]) -> None:
        mine, theirs = self.plan.identity(), state.get("plan", {})
        diff = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
        if diff:
            what = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in diff.items())
            raise ValueError(f"cannot resume the data stream exactly: {what}. Resume with the saved settings, "
                             "or start a new run from the checkpoint's weights (model.pretrained=CHECKPOINT)")
        self.batches = int(state["batches"])
        self.cursors = {int(w): list(c) for w, c in state["cursors"].items()}

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to (a reader that finished epoch e is at e + 1)."""
        return min(c[0] + int(c[3] >= self.plan.reader_length(c[0], w)) for w, c in self.cursors.items())


def _lower_priority(nice: int):
    def init(worker_id: int) -> None:
        os.nice(nice)

    return init


def make_loader(stream: TrainStream, num_workers: int, pin_memory: bool = False, worker_nice: int = 0,
                prefetch_factor: int = 2) -> DataLoader:
    """``worker_nice``: added to the workers' niceness. With the CPU saturated (training on CPU, or
    decoding-bound GPU hosts) the training process's threads then keep their cores and the workers,
    which run ahead by ``prefetch_factor`` batches each, fill the gaps (host memory:
    :mod:`mmpretrain.data.host_memory`)."""
    return DataLoader(
        stream,
        batch_size=None,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        pin_memory=pin_memory,
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
        multiprocessing_context="fork" if num_workers and sys.platform == "linux" else None,
        worker_init_fn=_lower_priority(worker_nice) if num_workers and worker_nice else None,
    )
