"""The training stream: a pure function of ``(seed, epoch, position)``.

**Readers.** A rank with ``W`` DataLoader workers runs ``W`` readers (one with 0 workers); reader
``k = rank * W + worker`` of ``R * W``. The DataLoader takes batches from its workers in turn, so the
rank's batch ``n`` comes from worker ``n % W``.

**Epoch mode** (``data.mode=epoch``). Each epoch the shards of all sources are put in an order seeded
by ``(seed, epoch)`` and their samples concatenated (``N`` positions). The sequence is cut into
``R * W`` equal contiguous ranges of ``L = floor(N / (R*W*B)) * B`` samples, in node-then-worker
order, so each reader opens only the shards its range touches (at most two readers share a shard).
Every rank therefore takes ``W * L / B`` steps per epoch and sees every sample of its ranges exactly
once; the ``N - R*W*L < R*W*B`` samples at the end are the dropped remainder (logged as
``dropped_remainder`` in ``skipped``). Each reader also owns an equal slice of that remainder as
spares: a reader whose range holds bad samples fills its last batch from its spares (still
"exactly once": spares are otherwise dropped), and only if they run out repeats its own earliest
good samples (counted as ``repeated_to_fill``), because every rank must take the same number of
equal-sized steps.

**Resampled mode** (``data.mode=resampled``). Reader ``k`` draws shards with replacement, a source
by ``data.weights`` then a shard uniformly, from a generator seeded by ``(seed, epoch, k)``. An epoch
is the sample budget ``data.num_samples`` (default: the dataset's size), ``L`` per reader as above.

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

Kept out of ``accelerator.prepare()``: the split by rank happens here, Accelerate would split again.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from mmpretrain.data.sources import Source, open_url

log = logging.getLogger(__name__)

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
MODES = ("epoch", "resampled")


class SkipSample(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# ---------------------------------------------------------------------------------------------- reading


def _split_name(name: str) -> tuple[str, str] | None:
    """webdataset's rule: key = path up to the first dot of the file name, suffix = the rest (lower case)."""
    base = name.rsplit("/", 1)[-1]
    dot = base.find(".")
    if dot <= 0:
        return None
    return name[: len(name) - len(base) + dot], base[dot + 1:].lower()


def _members(f) -> Iterator[tuple[str, int, bool]]:
    """``(name, size, is_file)`` of each tar member, leaving ``f`` at the member's data: ustar, pax
    (``path``/``size`` records) and GNU long names; a short read raises EOFError. About 5x faster than
    ``tarfile`` in stream mode, which builds a TarInfo and parses every pax header in Python objects."""
    long_name, pax_name, pax_size = None, None, None
    while True:
        h = f.read(512)
        if len(h) < 512:
            if h.strip(b"\0"):
                raise EOFError("truncated tar header")
            return
        if not h.strip(b"\0"):
            return  # end-of-archive block
        size_field = h[124:136]
        if size_field[0] & 0x80:  # GNU base-256 size
            size = int.from_bytes(size_field[1:], "big")
        else:
            size = int(size_field.strip(b"\0 ") or b"0", 8)
        kind = h[156:157]
        if kind in (b"x", b"g", b"L"):
            data = f.read(size)
            f.read(-size % 512)
            if len(data) < size:
                raise EOFError("truncated tar header data")
            if kind == b"L":
                long_name = data.rstrip(b"\0").decode("utf-8", "surrogateescape")
            elif kind == b"x":
                i = 0
                while i < len(data):
                    sp = data.index(b" ", i)
                    n = int(data[i:sp])
                    k, _, v = data[sp + 1:i + n - 1].partition(b"=")
                    if k == b"path":
                        pax_name = v.decode("utf-8", "surrogateescape")
                    elif k == b"size":
                        pax_size = int(v)
                    i += n
            continue
        name = long_name or pax_name
        if name is None:
            name = h[0:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            prefix = h[345:500].split(b"\0", 1)[0]
            if prefix and h[257:262] == b"ustar":
                name = prefix.decode("utf-8", "surrogateescape") + "/" + name
        if pax_size is not None:
            size = pax_size
        long_name, pax_name, pax_size = None, None, None
        yield name, size, kind in (b"0", b"\0", b"7")


def read_tar(url: str, skip: int = 0) -> Iterator[dict[str, Any]]:
    """Samples of one shard (``__key__`` + one bytes value per suffix), after ``skip`` samples whose
    bytes are never copied out. Raises on an unreadable or truncated tar after yielding what it read."""
    import gzip

    raw = open_url(url)
    stream = raw
    try:
        if not hasattr(stream, "peek"):
            stream = io.BufferedReader(stream if hasattr(stream, "readinto") else _RawAdapter(stream), 1 << 20)
        if stream.peek(2)[:2] == b"\x1f\x8b":
            stream = io.BufferedReader(gzip.GzipFile(fileobj=stream), 1 << 20)
        key, sample, n = None, {}, 0
        for name, size, is_file in _members(stream):
            parts = _split_name(name) if is_file else None
            if parts is not None and parts[0] != key:
                if key is not None:
                    if n >= skip:
                        yield sample
                    n += 1
                key, sample = parts[0], {"__key__": parts[0]}
            pad = -size % 512
            if parts is not None and n >= skip:
                data = stream.read(size)
                if len(data) < size:
                    raise EOFError(f"tar member {name} cut short")
                sample[parts[1]] = data
                stream.read(pad)
            else:
                _skip(stream, size + pad)
        if key is not None and n >= skip:
            yield sample
    finally:
        raw.close()


class _RawAdapter(io.RawIOBase):
    """A raw stream over anything with ``read(n)`` (webdataset's ``Pipe``)."""

    def __init__(self, src):
        self.src = src

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        data = self.src.read(len(b))
        b[: len(data)] = data
        return len(data)


def _skip(f, n: int) -> None:
    if n and f.seekable():
        f.seek(n, io.SEEK_CUR)
        return
    while n > 0:
        chunk = f.read(min(n, 1 << 20))
        if not chunk:
            raise EOFError("tar data cut short")
        n -= len(chunk)


@dataclass(frozen=True)
class Segment:
    shard: int  # index into the flat shard list
    start: int  # first sample index inside the shard
    stop: int


class SegmentReader:
    """Raw samples at increasing positions of a reader's sequence of segments; a position whose sample
    cannot be read comes back as the reason string."""

    def __init__(self, urls: list[str], segments: Iterator[Segment]):
        self.urls = urls
        self.segments = segments
        self.seg: Segment | None = None
        self.seg_pos = 0  # position of self.seg's first sample
        self.it: Iterator[dict[str, Any]] | None = None
        self.next_in_seg = 0  # sample index (within the segment) self.it yields next
        self.failed: str | None = None

    def _advance_to(self, pos: int) -> None:
        while self.seg is None or pos >= self.seg_pos + (self.seg.stop - self.seg.start):
            if self.seg is not None:
                self.seg_pos += self.seg.stop - self.seg.start
            self.seg = next(self.segments)
            self.it, self.next_in_seg, self.failed = None, 0, None

    def get(self, pos: int) -> dict[str, Any] | str:
        self._advance_to(pos)
        seg = self.seg
        want = pos - self.seg_pos
        if self.failed:
            return self.failed
        if self.it is None or want < self.next_in_seg:
            self.it = read_tar(self.urls[seg.shard], skip=seg.start + want)
            self.next_in_seg = want
        try:
            while self.next_in_seg < want:  # skip without decoding
                next(self.it)
                self.next_in_seg += 1
            raw = next(self.it)
            self.next_in_seg += 1
            return raw
        except StopIteration:
            self.failed = "missing_in_shard"  # fewer samples than sizes.json says
        except (OSError, EOFError, ValueError) as e:
            log.warning("shard %s unreadable after %d samples: %s", self.urls[seg.shard], seg.start + want, e)
            self.failed = "unreadable_shard"
        return self.failed


# ---------------------------------------------------------------------------------------------- planning


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


# ---------------------------------------------------------------------------------------------- decoding


def augmentation_seed(seed: int, epoch: int, key: str) -> int:
    h = hashlib.blake2b(f"{seed}:{epoch}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & (2**63 - 1)


class SampleDecoder:
    """Raw sample -> dict(image tensor, caption, key, emb?); raises :class:`SkipSample`.

    ``embeddings``: ``"require"`` (missing -> skip, counted), ``"optional"``, or ``"ignore"``.
    ``draft_size``: JPEGs are decoded at the smallest DCT scale still at least this large (Pillow's
    draft mode), which is most of the decoding cost saved for web images larger than the model input."""

    def __init__(self, transform, embeddings: str = "optional", draft_size: int | None = None, labels: bool = False):
        self.transform = transform
        self.labels = labels
        self.embeddings = embeddings
        self.draft_size = draft_size

    def __call__(self, raw: dict[str, Any], seed: int, epoch: int) -> dict[str, Any]:
        ext = next((e for e in IMAGE_EXTS if e in raw), None)
        if ext is None:
            raise SkipSample("missing_image")
        if "txt" not in raw:
            raise SkipSample("missing_caption")
        try:
            caption = raw["txt"].decode("utf-8").strip()
        except UnicodeDecodeError:
            raise SkipSample("caption_not_utf8") from None
        if not caption:
            raise SkipSample("empty_caption")
        emb = None
        if self.embeddings != "ignore":
            if "emb.npy" in raw:
                try:
                    emb = torch.from_numpy(np.load(io.BytesIO(raw["emb.npy"])).astype(np.float32))
                except ValueError:
                    raise SkipSample("bad_embedding") from None
            elif self.embeddings == "require":
                raise SkipSample("missing_embedding")
        try:
            img = Image.open(io.BytesIO(raw[ext]))
            if self.draft_size and img.format == "JPEG":
                img.draft("RGB", (self.draft_size, self.draft_size))
            img.load()
            img = img.convert("RGB")
        except Image.DecompressionBombError:
            raise SkipSample("decompression_bomb") from None
        except Exception:
            raise SkipSample("undecodable_image") from None
        # the CPU generator only: torch.manual_seed also seeds (lazily) every CUDA device, ~1 ms a call
        gen = torch.default_generator
        saved = gen.get_state()
        try:
            gen.manual_seed(augmentation_seed(seed, epoch, raw["__key__"]))
            image = self.transform(img)
        finally:
            gen.set_state(saved)
        out: dict[str, Any] = {"image": image, "text": caption, "key": raw["__key__"]}
        if emb is not None:
            out["emb"] = emb
        if self.labels:
            out["label"] = sample_label(raw)
        return out


def sample_label(raw: dict[str, Any]) -> int:
    """The class index of a sample (webdataset's ``cls``, else ``label`` in its ``json``); -1 when absent.
    Only diagnostics read it (region purity), so an unreadable one counts as absent."""
    try:
        if "cls" in raw:
            return int(raw["cls"].decode().strip())
        if "json" in raw:
            label = json.loads(raw["json"]).get("label")
            return int(label) if isinstance(label, int) else -1
    except (ValueError, UnicodeDecodeError, AttributeError):
        pass
    return -1


def collate(items: list[dict[str, Any]], tokenizer=None) -> dict[str, Any]:
    batch: dict[str, Any] = {
        "images": torch.stack([it["image"] for it in items]),
        "texts": [it["text"] for it in items],
        "keys": [it["key"] for it in items],
    }
    if tokenizer is not None:
        batch["tokens"] = tokenizer(batch["texts"])
    if all("emb" in it for it in items):
        batch["target_embeddings"] = torch.stack([it["emb"] for it in items])
    if all("label" in it for it in items):
        batch["labels"] = torch.tensor([it["label"] for it in items], dtype=torch.long)
    return batch


# ---------------------------------------------------------------------------------------------- the stream


class Reader:
    """One reader's samples for one epoch, from a cursor ``[epoch, block_start, consumed, emitted]``."""

    def __init__(self, plan: StreamPlan, decoder: SampleDecoder, rank: int, worker: int):
        self.plan, self.decoder, self.rank, self.worker = plan, decoder, rank, worker
        self.index = rank * plan.workers + worker

    def epoch(self, cursor: list[int], skipped: Counter) -> Iterator[tuple[dict[str, Any], list[int]]]:
        plan = self.plan
        epoch, pos, k0, emitted = cursor
        L, S = plan.per_reader, max(1, plan.shuffle_block)
        if plan.mode == "epoch":
            main, spare = plan.reader_layout(epoch, self.index)
            M = sum(s.stop - s.start for s in main)
            P = sum(s.stop - s.start for s in spare)

            def segments():
                yield from main
                yield from spare
                while True:  # repeating the reader's own range, only to fill after bad samples
                    yield from main
        else:
            M, P = None, 0
            segments = lambda: plan.drawn_segments(epoch, self.index)  # noqa: E731
        reader = SegmentReader(plan.urls, segments())
        fruitless = 0
        while emitted < L:
            if M is None or pos < M:  # shuffled blocks (never crossing into the spares)
                end = pos + S if M is None else min(pos + S, M)
                perm = list(range(pos, end))
                if plan.shuffle_block > 1:
                    random.Random(f"{plan.seed}:{epoch}:{self.rank}:{self.worker}:{pos // S}").shuffle(perm)
                repeat = False
            else:  # spares, then repeats: in order
                end = pos + 1
                perm = [pos]
                repeat = pos >= M + P
            # only the slots not consumed yet are read (a resumed block skips the rest without extracting)
            raws = {p: reader.get(p) for p in sorted(perm[k0:])}
            for j in range(k0, len(perm)):
                raw = raws[perm[j]]
                # a bad sample met again while repeating was counted in the first pass of this epoch
                if isinstance(raw, str):
                    skipped[raw] += not repeat
                    continue
                try:
                    item = self.decoder(raw, plan.seed, epoch)
                except SkipSample as e:
                    skipped[e.reason] += not repeat
                    continue
                if repeat:
                    skipped["repeated_to_fill"] += 1
                emitted += 1
                fruitless = 0
                yield item, [epoch, pos, j + 1, emitted]
                if emitted == L:
                    return
            fruitless += end - pos
            if fruitless > (M + P + 1 if M is not None else 10 * L + 10_000):
                raise RuntimeError(f"reader {self.index} (rank {self.rank}, worker {self.worker}) found no "
                                   f"decodable sample in its share of epoch {epoch}; check the data "
                                   "(python -m data_tools verify)")
            pos, k0 = end, 0


class TrainStream(IterableDataset):
    """Endless batches of one rank. ``start``: :class:`StreamPosition` state to resume from."""

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
            if cursor[3] >= self.plan.per_reader:  # a finished epoch: start the next
                cursor = [epoch + 1, 0, 0, 0]
                continue
            skipped: Counter = Counter()
            if cursor[3] == 0 and worker == 0 and self.plan.dropped_per_epoch:
                # the remainder that no reader of this rank emits, counted once per epoch by worker 0
                # of every rank, as its share of the total
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
        return min(c[0] + int(c[3] >= self.plan.per_reader) for c in self.cursors.values())


def check_shard_count(num_shards: int, world_size: int, num_workers: int) -> None:
    need = world_size * max(1, num_workers)
    if num_shards < need:
        raise ValueError(
            f"data.train has {num_shards} shard(s) but {world_size} rank(s) x {max(1, num_workers)} worker(s) "
            f"= {need} readers: lower data.num_workers or write smaller shards (data_tools build --shard-size)"
        )


def _lower_priority(nice: int):
    def init(worker_id: int) -> None:
        import os

        os.nice(nice)

    return init


def make_loader(stream: TrainStream, num_workers: int, pin_memory: bool = False, worker_nice: int = 0) -> DataLoader:
    """``worker_nice``: added to the workers' niceness. With the CPU saturated (training on CPU, or
    decoding-bound GPU hosts) the training process's threads then keep their cores and the workers,
    which run ahead by ``prefetch_factor`` batches, fill the gaps."""
    import sys

    return DataLoader(
        stream,
        batch_size=None,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        pin_memory=pin_memory,
        prefetch_factor=4 if num_workers > 0 else None,
        multiprocessing_context="fork" if num_workers and sys.platform == "linux" else None,
        worker_init_fn=_lower_priority(worker_nice) if num_workers and worker_nice else None,
    )
