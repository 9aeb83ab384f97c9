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
The parts, one idea each: :mod:`~mmpretrain.data.plan` (which segments each reader reads; no I/O),
:mod:`~mmpretrain.data.segments` (raw samples at positions of those segments, through
:mod:`~mmpretrain.data.tar`), :mod:`~mmpretrain.data.decode` (raw sample -> item),
:mod:`~mmpretrain.data.reader` (one reader's epoch: range, spares, fill), :mod:`~mmpretrain.data.batch`
(items -> the typed batch), :mod:`~mmpretrain.data.position` (the resumable position) and
:mod:`~mmpretrain.data.loader` (the DataLoader); this module is the rank's endless stream of batches.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from mmpretrain.data.batch import Batch, collate
from mmpretrain.data.decode import SampleDecoder
from mmpretrain.data.loader import make_loader
from mmpretrain.data.plan import StreamPlan
from mmpretrain.data.position import StreamPosition
from mmpretrain.data.reader import Reader, StreamError

# the stream's parts, importable from here as before the split
__all__ = ["Reader", "StreamError", "StreamPosition", "TrainStream", "collate", "make_loader"]


class TrainStream(IterableDataset):
    """Endless :class:`~mmpretrain.data.batch.Batch` records of one rank, with the ``skipped`` counts, the
    ``epoch`` (0-based) each belongs to, its ``worker`` and the reader's ``cursor`` after it.
    ``start``: :class:`StreamPosition` state to resume from."""

    def __init__(self, plan: StreamPlan, decoder: SampleDecoder, rank: int, tokenizer=None,
                 start: dict[str, Any] | None = None, patch_size: int = 0):
        super().__init__()
        self.plan, self.decoder, self.rank, self.tokenizer = plan, decoder, rank, tokenizer
        self.patch_size = patch_size  # data.naflex: the image tower's patch (images become patch sequences)
        self.cursors = {w: [0, 0, 0, 0] for w in range(plan.workers)}
        self.first_worker = 0
        if start is not None:
            self.cursors = {int(w): list(c) for w, c in start["cursors"].items()}
            self.first_worker = start["batches"] % plan.workers

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        physical, n = (info.id, info.num_workers) if info else (0, 1)
        if n != self.plan.workers:
            raise RuntimeError(f"stream planned for {self.plan.workers} reader(s) per rank but run by {n} "
                               "DataLoader worker(s)")
        worker = (physical + self.first_worker) % n  # the loader starts at physical worker 0
        reader = Reader(self.plan, self.decoder, self.rank, worker)
        cursor = list(self.cursors[worker])
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
            # this worker's batches of the epoch (size, NaFlex length), from the one the cursor stands at
            steps = self.plan.worker_steps(epoch, worker)
            done, k = 0, 0
            while done < cursor[3]:
                done, k = done + steps[k][0], k + 1
            items: list[dict[str, Any]] = []
            for item, after in reader.epoch(cursor, skipped):
                items.append(item)
                if len(items) == steps[k][0]:
                    batch = collate(items, self.tokenizer, seq_len=steps[k][1], patch_size=self.patch_size)
                    k += 1
                    batch.skipped, batch.epoch, batch.worker, batch.cursor = dict(skipped), epoch, worker, list(after)
                    yield batch
                    items = []
                    skipped.clear()  # in place: the reader holds this counter
            cursor = [epoch + 1, 0, 0, 0]
