"""Reading whole shards: raw samples of one tar, as the data tools and evaluation read them.
The training stream (positions, skipping, decoding) is in :mod:`mmpretrain.data.stream`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from mmpretrain.data.stream import IMAGE_EXTS, SkipSample

__all__ = ["IMAGE_EXTS", "SkipSample", "iter_samples"]


def iter_samples(url: str | Path, handler: Callable[[Exception], bool] | None = None) -> Iterator[dict[str, Any]]:
    """Raw samples (``__key__`` plus one bytes value per member suffix) of one tar shard, through
    webdataset's tar reader; ``handler(exception)`` returning True skips what cannot be read."""
    from webdataset.handlers import reraise_exception
    from webdataset.tariterators import tarfile_samples

    yield from tarfile_samples(iter([{"url": str(url)}]), handler=handler or reraise_exception)
