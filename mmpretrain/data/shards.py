"""Streaming WebDataset loader: shard urls -> batches of (images, tokens, target embeddings).

The stream is a pure function of ``(seed, epoch, rank, worker)``: the shard order of each epoch is
a permutation seeded by ``(seed, epoch)``, shards are split by rank then by worker, and the sample
shuffle buffer is seeded by ``(seed, epoch, rank, worker)`` (open_clip seeds it from pid and time).
Each worker streams its shards epoch after epoch without end; the trainer decides how many batches
make a run. Bad samples are skipped and counted by reason; each batch carries the counts of the
samples skipped since the previous batch of its worker, so the trainer can log them.

Kept out of ``accelerator.prepare()``: Accelerate would re-split what is split here already.
"""

from __future__ import annotations

import io
import logging
import random
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from mmpretrain.data.manifest import read_sizes

log = logging.getLogger(__name__)

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")


class SkipSample(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def iter_samples(url: str | Path, handler: Callable[[Exception], bool] | None = None) -> Iterator[dict[str, Any]]:
    """Raw samples (``__key__`` plus one bytes value per member suffix) of one tar shard."""
    from webdataset.handlers import reraise_exception
    from webdataset.tariterators import tarfile_samples

    yield from tarfile_samples(iter([{"url": str(url)}]), handler=handler or reraise_exception)


def resolve_shards(spec: str) -> tuple[list[str], int | None]:
    """Shard urls and their total sample count (None when unknown) for a spec: dataset folders
    (with ``sizes.json``) and/or brace-expanded url patterns, joined by ``::``."""
    from braceexpand import braceexpand

    urls: list[str] = []
    total: int | None = 0
    for part in spec.split("::"):
        p = Path(part)
        if p.is_dir():
            sizes = read_sizes(p)
            urls += [str(p / name) for name in sorted(sizes)]
            if total is not None:
                total += sum(sizes.values())
        else:
            expanded = list(braceexpand(part))
            missing = [u for u in expanded if "://" not in u and not u.startswith("pipe:") and not Path(u).exists()]
            if missing:
                raise FileNotFoundError(f"data.train: shard {missing[0]} does not exist ({len(missing)} missing)")
            urls += expanded
            total = None
    if not urls:
        raise FileNotFoundError(f"data.train={spec!r} names no shards")
    return urls, total


class SampleDecoder:
    """Raw sample -> dict(image tensor, caption, key, tokens?, emb?); raises :class:`SkipSample`.

    ``embeddings``: ``"require"`` (missing -> skip, counted), ``"optional"``, or ``"ignore"``."""

    def __init__(self, transform: Callable, tokenizer: Callable | None = None, embeddings: str = "optional"):
        self.transform = transform
        self.tokenizer = tokenizer
        self.embeddings = embeddings

    def __call__(self, raw: dict[str, Any]) -> dict[str, Any]:
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
        try:
            img = Image.open(io.BytesIO(raw[ext]))
            img.load()
            img = img.convert("RGB")
        except Exception:
            raise SkipSample("undecodable_image") from None
        out: dict[str, Any] = {"image": self.transform(img), "text": caption, "key": raw["__key__"]}
        if self.tokenizer is not None:
            out["tokens"] = self.tokenizer([caption])[0]
        if self.embeddings != "ignore":
            if "emb.npy" in raw:
                out["emb"] = torch.from_numpy(np.load(io.BytesIO(raw["emb.npy"])).astype(np.float32))
            elif self.embeddings == "require":
                raise SkipSample("missing_embedding")
        return out


def collate(items: list[dict[str, Any]], skipped: Counter, epoch: int) -> dict[str, Any]:
    batch: dict[str, Any] = {
        "images": torch.stack([it["image"] for it in items]),
        "texts": [it["text"] for it in items],
        "keys": [it["key"] for it in items],
        "skipped": dict(skipped),
        "epoch": epoch,
    }
    if "tokens" in items[0]:
        batch["tokens"] = torch.stack([it["tokens"] for it in items])
    if all("emb" in it for it in items):
        batch["target_embeddings"] = torch.stack([it["emb"] for it in items])
    return batch


class ShardStream(IterableDataset):
    """Endless per-rank stream of batches; see the module docstring for the seeding rules."""

    def __init__(
        self,
        urls: list[str],
        decoder: SampleDecoder,
        *,
        batch_size: int,
        seed: int,
        shuffle_buffer: int,
        rank: int,
        world_size: int,
        start_epoch: int = 0,
    ):
        super().__init__()
        self.urls = list(urls)
        self.decoder = decoder
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle_buffer = shuffle_buffer
        self.rank = rank
        self.world_size = world_size
        self.start_epoch = start_epoch

    def shards_for(self, epoch: int, worker: int, num_workers: int) -> list[str]:
        order = list(self.urls)
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order[self.rank :: self.world_size][worker::num_workers]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info else (0, 1)
        skipped: Counter = Counter()

        def on_tar_error(exn: Exception) -> bool:
            skipped["unreadable_tar"] += 1
            log.warning("skipping unreadable shard data: %s", exn)
            return True

        pending: list[dict[str, Any]] = []
        epoch = self.start_epoch
        while True:
            mine = self.shards_for(epoch, worker, num_workers)
            if not mine:
                raise RuntimeError(
                    f"rank {self.rank} worker {worker} has no shards ({len(self.urls)} shards for "
                    f"{self.world_size} rank(s) x {num_workers} worker(s))"
                )
            rng = random.Random(f"{self.seed}:{epoch}:{self.rank}:{worker}")
            buf: list[dict[str, Any]] = []
            for url in mine:
                for raw in iter_samples(url, handler=on_tar_error):
                    try:
                        item = self.decoder(raw)
                    except SkipSample as e:
                        skipped[e.reason] += 1
                        continue
                    if self.shuffle_buffer > 0:
                        buf.append(item)
                        if len(buf) < self.shuffle_buffer:
                            continue
                        j = rng.randrange(len(buf))
                        buf[j], buf[-1] = buf[-1], buf[j]
                        item = buf.pop()
                    pending.append(item)
                    if len(pending) == self.batch_size:
                        yield collate(pending, skipped, epoch)
                        pending, skipped = [], Counter()
            rng.shuffle(buf)
            for item in buf:
                pending.append(item)
                if len(pending) == self.batch_size:
                    yield collate(pending, skipped, epoch)
                    pending, skipped = [], Counter()
            epoch += 1


def check_shard_count(num_shards: int, world_size: int, num_workers: int) -> None:
    need = world_size * max(1, num_workers)
    if num_shards < need:
        raise ValueError(
            f"data.train has {num_shards} shard(s) but {world_size} rank(s) x {max(1, num_workers)} worker(s) "
            f"= {need} readers: lower data.num_workers or write smaller shards (data_tools build --shard-size)"
        )


def make_loader(stream: ShardStream, num_workers: int, pin_memory: bool = False) -> DataLoader:
    check_shard_count(len(stream.urls), stream.world_size, num_workers)
    return DataLoader(
        stream,
        batch_size=None,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        pin_memory=pin_memory,
        prefetch_factor=4 if num_workers > 0 else None,
    )
