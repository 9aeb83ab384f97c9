"""Dataset folder layout shared by ``data_tools`` and the loader.

A dataset folder holds tar shards, ``sizes.json`` (shard name -> sample count, as open_clip reads
it) and ``manifest.json`` (source, options, tool version, counts, ``skipped`` by reason, and
``embedding: {model, dim, normalized}`` once embedded).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

SIZES = "sizes.json"
MANIFEST = "manifest.json"


def write_json_atomic(path: str | Path, data: Any, allow_nan: bool = True) -> None:
    """Write JSON through a temporary file and rename, so a reader never sees half a file. ``allow_nan``
    False: strict JSON (a NaN or infinity is a ValueError before anything is written)."""
    path = Path(path)
    text = json.dumps(data, indent=2, sort_keys=False, allow_nan=allow_nan)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
        f.write("\n")
    os.replace(tmp, path)


def read_sizes(folder: str | Path) -> dict[str, int]:
    p = Path(folder) / SIZES
    if not p.is_file():
        raise FileNotFoundError(
            f"{p} not found: {folder} is not a dataset folder; build one with `python -m data_tools build`"
        )
    try:
        return check_sizes(json.loads(p.read_text()), str(p))
    except json.JSONDecodeError as e:
        raise ValueError(f"{p} is not valid JSON ({e}); rebuild it (python -m data_tools build) or fix it") from None


def check_sizes(sizes: Any, where: str) -> dict[str, int]:
    """A sizes.json's content: shard file name -> sample count, each a non-negative integer."""
    if not isinstance(sizes, dict):
        raise ValueError(f"{where} must map shard file names to sample counts, not {type(sizes).__name__}")
    bad = [(k, v) for k, v in sizes.items() if not isinstance(v, int) or isinstance(v, bool) or v < 0]
    if bad:
        raise ValueError(f"{where}: the count of {bad[0][0]!r} is {bad[0][1]!r}; every count must be a whole "
                         f"number >= 0 ({len(bad)} bad). Rebuild it or fix it")
    return sizes


def read_manifest(folder: str | Path) -> dict[str, Any]:
    p = Path(folder) / MANIFEST
    return json.loads(p.read_text()) if p.is_file() else {}


def shard_paths(folder: str | Path) -> list[Path]:
    """Shards listed in ``sizes.json``, in name order; each must exist."""
    folder = Path(folder)
    paths = [folder / name for name in sorted(read_sizes(folder))]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"shards listed in {folder / SIZES} are missing: {missing[:5]}")
    return paths


def provenance_record(spec: str, manifest: dict[str, Any], samples: int,
                      keep: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a run records of one training source (``provenance.json``'s ``data``), from its manifest:
    the source it was built from, a dataset name where the source has one (``demo:NAME``,
    ``hf:NAME[:SPLIT]``), the licence and attribution the build recorded (None when not), and with
    ``data.keep`` the keep-list (folder, rules, kept of total, digest)."""
    source = manifest.get("source")
    dataset = None
    if isinstance(source, str) and source.startswith("demo:"):
        dataset = source.removeprefix("demo:")
    elif isinstance(source, str) and source.startswith("hf:"):
        dataset = source.removeprefix("hf:").split(":")[0]
    return {"spec": spec, "source": source, "dataset": dataset, "license": manifest.get("license"),
            "attribution": manifest.get("attribution"), "samples": samples, **({"keep": keep} if keep else {})}
