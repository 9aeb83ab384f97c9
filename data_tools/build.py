"""``build SOURCE --out DIR``: shards from a source, with a held-out split where the source has one."""

from __future__ import annotations

import json
from pathlib import Path

from data_tools.demo import build_demo
from data_tools.writers import (
    BuildError,
    foreign_tars,
    recorded_files,
    remove_files,
    write_clip_benchmark_wds,
)
from mmpretrain.data.manifest import SIZES, write_json_atomic

__all__ = ["BuildError", "build", "check_source_and_out", "recorded_files", "write_clip_benchmark_wds"]


def check_source_and_out(source: str, out: Path) -> None:
    """``build`` reads SOURCE and writes --out: an --out equal to, inside or above the source is refused
    (an --overwrite there would delete the input before reading it)."""
    if source.startswith(("hf:", "demo:")) and not Path(source).exists():
        return
    src, o = Path(source).resolve(), out.resolve()
    where = "is" if o == src else "is inside" if src in o.parents else "contains" if o in src.parents else None
    if where:
        raise BuildError(f"--out {out} {where} the source {source}: build writes beside nothing it reads. "
                         "Choose an --out outside the source")


def _claim_out(out: Path, manifest: dict, overwrite: bool) -> None:
    """Resume only a build of the same source with the same options; anything else needs --overwrite,
    which removes only the files the earlier build wrote. Tar files no build wrote are refused."""
    from data_tools.parallel import STATS_DIR

    marker = out / STATS_DIR / "build.json"
    ours = recorded_files(out)
    foreign = foreign_tars(out, ours)
    if foreign:
        raise BuildError(f"--out {out} holds {foreign[0]} ({len(foreign)} tar file(s)) that no build wrote: the "
                         "new shards would mix with (or replace) them. Choose an empty folder")
    existing = (out / SIZES).is_file() or marker.is_file() or bool(ours)
    if existing and overwrite:
        remove_files(ours | ({marker} if marker.is_file() else set()))
    elif existing:
        previous = json.loads(marker.read_text()) if marker.is_file() else None
        if previous != {"source": manifest["source"], "options": manifest["options"]}:
            raise BuildError(f"{out} already holds a dataset that is not this build (another source or other "
                             "options); pass --overwrite to rebuild it, or choose another --out")
    write_json_atomic(marker, {"source": manifest["source"], "options": manifest["options"]})


def build(source: str, out: str | Path, *, image_size: int, shard_size: int, limit: int | None = None,
          image_format: str | None = None, overwrite: bool = False, source_type: str | None = None,
          image_column: str | None = None, caption_column: str | None = None, key_column: str | None = None,
          base_dir: str | None = None, captions: str | None = None, workers: int = 1, shard_bytes: float = 1e9,
          quality: int = 95, max_pixels: int = 64_000_000, second_style: str | None = None,
          extra_captions_column: str | None = None, negative_captions_column: str | None = None) -> dict:
    """Build ``out`` from ``source``. Demo sources write ``out/train`` and ``out/test``; other sources
    write one dataset folder ``out``. Re-running an interrupted build of the same source resumes it."""
    from data_tools.parallel import build_parallel
    from data_tools.sources.files import open_source
    from data_tools.sources.records import SourceError

    out = Path(out)
    check_source_and_out(source, out)
    if source.startswith("demo:") or source_type == "demo":
        return build_demo(source, out, image_size=image_size, shard_size=shard_size, limit=limit,
                          image_format=image_format or "png", workers=workers, overwrite=overwrite,
                          second_style=second_style)
    try:
        src = open_source(source, source_type, image_column=image_column, caption_column=caption_column,
                          base_dir=base_dir, key_column=key_column, captions=captions,
                          extra_column=extra_captions_column, negative_column=negative_captions_column)
    except SourceError as e:
        raise BuildError(str(e)) from None
    if limit is not None and hasattr(src, "files"):
        src.files = src.files[:limit]
    opts = {"image_size": image_size, "image_format": image_format or "jpg", "quality": quality,
            "max_pixels": max_pixels, "shard_bytes": shard_bytes}
    manifest = {"source": str(source), "source_kind": src.kind,
                "options": dict(opts, shard_size=shard_size, image_column=image_column,
                                caption_column=caption_column, key_column=key_column, base_dir=base_dir,
                                limit=limit, **({"extra_captions_column": extra_captions_column}
                                                if extra_captions_column else {}),
                                **({"negative_captions_column": negative_captions_column}
                                   if negative_captions_column else {}))}
    _claim_out(out, manifest, overwrite)
    return build_parallel(src, out, prefix=out.resolve().name or "shard", shard_size=shard_size,
                          workers=workers, opts=opts, manifest=manifest)


