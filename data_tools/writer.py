"""Write samples into WebDataset shards with webdataset's ShardWriter, plus sizes.json/manifest.json."""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import webdataset as wds
from PIL import Image

from data_tools import __version__
from data_tools.images import BadImage, encode, prepare
from mmpretrain.data.manifest import MANIFEST, SIZES, write_json_atomic


@dataclass
class Sample:
    key: str
    image: Image.Image
    caption: str
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class SplitResult:
    folder: Path
    sizes: dict[str, int]
    skipped: Counter

    @property
    def count(self) -> int:
        return sum(self.sizes.values())


def write_split(
    samples: Iterable[Sample],
    folder: str | Path,
    *,
    prefix: str,
    image_size: int,
    image_format: str = "jpg",
    quality: int = 95,
    shard_size: int = 1000,
    shard_bytes: float = 1e9,
    max_pixels: int = 64_000_000,
    manifest: dict[str, Any] | None = None,
) -> SplitResult:
    """Normalise and write ``samples`` as ``{prefix}-{i:06d}.tar`` shards in ``folder``.

    Bad samples are skipped and counted by reason in the manifest, never silently dropped."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    skipped: Counter = Counter()
    sizes: Counter = Counter()
    pattern = str(folder / f"{prefix}-%06d.tar")
    ext = image_format
    with wds.ShardWriter(pattern, maxcount=shard_size, maxsize=shard_bytes, verbose=0, encoder=False) as w:
        for s in samples:
            caption = s.caption.strip()
            if not caption:
                skipped["empty_caption"] += 1
                continue
            try:
                img = prepare(s.image, image_size, max_pixels)
                data = encode(img, image_format, quality)
            except BadImage as e:
                skipped[e.reason] += 1
                continue
            meta = dict(s.meta, width=img.width, height=img.height)
            w.write(
                {
                    "__key__": s.key,
                    ext: data,
                    "txt": caption.encode("utf-8"),
                    "json": json.dumps(meta, ensure_ascii=False).encode("utf-8"),
                }
            )
            sizes[os.path.basename(w.fname)] += 1
    # ShardWriter opens its first shard eagerly; an empty split leaves an empty tar behind.
    for p in folder.glob(f"{prefix}-*.tar"):
        if p.name not in sizes:
            p.unlink()
    sizes_sorted = dict(sorted(sizes.items()))
    write_json_atomic(folder / SIZES, sizes_sorted)
    man = dict(manifest or {})
    man.update(
        {
            "tool": "data_tools",
            "tool_version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "counts": {"samples": sum(sizes.values()), "shards": len(sizes)},
            "skipped": dict(skipped),
            "image_format": image_format,
            "image_size": image_size,
        }
    )
    write_json_atomic(folder / MANIFEST, man)
    return SplitResult(folder, sizes_sorted, skipped)


