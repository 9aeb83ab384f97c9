"""Training data sources: which shards, how many samples each, how to open them.

``data.train`` is one or more sources joined by ``::``; each source is a dataset folder (with the
``sizes.json`` that ``data_tools build`` writes) or a brace-expanded shard pattern:

- local paths and ``file://`` urls;
- ``pipe:COMMAND`` (the command writes the tar to stdout, e.g. ``pipe:cat /data/s-{000..009}.tar`` or
  ``pipe:aws s3 cp s3://bucket/s-{000..009}.tar -``);
- fsspec urls (``s3://``, ``gs://``, ``hf://``, ``https://`` ...), opened with ``fsspec.open`` under
  ``data.remote``'s timeouts and storage options, retried where they fail (mmpretrain/data/urls.py).

Every shard's sample count must be known (exact epochs, and resuming without reading what was
already seen, both depend on it): from the folder's ``sizes.json``, or for a pattern from a
``sizes.json`` in the directory of its shards (for ``pipe:`` the last word of the command is taken as
the shard path). ``data.weights`` gives each source a sampling weight (resampled mode).
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from braceexpand import braceexpand

from mmpretrain.config.base import RemoteConfig
from mmpretrain.data.manifest import MANIFEST, SIZES, check_sizes, read_manifest, read_sizes
from mmpretrain.data.urls import describe, is_local, missing_object, open_url, shard_path


@dataclass
class Source:
    spec: str
    urls: list[str]
    sizes: list[int]
    weight: float = 1.0
    manifest: dict[str, Any] = field(default_factory=dict)  # the dataset's manifest.json ({} when absent)
    embeddings: Any = None  # mmpretrain.data.sidecar.SourceEmbeddings when caption embeddings lie beside the shards
    teachers: Any = None  # mmpretrain.data.teacher.SourceTeachers when an objective distills from stored teachers
    # (their record, whatever the layout: mmpretrain.data.sidecar.recorded)
    # data.keep (mmpretrain.data.keep.attach_keep): `sizes` are then the kept counts, `full_sizes` the
    # shards' counts, `keep` one ShardKeep per shard and `keep_record` what provenance records of the list
    full_sizes: list[int] | None = None
    keep: list | None = None
    keep_record: dict | None = None
    remote: RemoteConfig | None = None  # data.remote: the options every read of its files is opened with

    @property
    def num_samples(self) -> int:
        return sum(self.sizes)

    @property
    def shard_counts(self) -> list[int]:
        """Each shard's count in sizes.json (its sample positions; ``sizes`` are the kept ones with data.keep)."""
        return self.full_sizes or self.sizes


def _near(urls: list[str], name: str) -> str:
    folder = posixpath.dirname(shard_path(urls[0]))
    return posixpath.join(folder, name) if folder else name


def _read_json(url: str, remote: RemoteConfig | None) -> Any:
    if is_local(url):
        return json.loads(Path(url).read_text())
    with open_url(url, remote) as f:
        return json.loads(f.read().decode("utf-8"))


def _read_sizes_near(urls: list[str], spec: str, remote: RemoteConfig | None) -> dict[str, int]:
    sizes_url = _near(urls, SIZES)
    try:
        sizes = _read_json(sizes_url, remote)
    except ImportError as e:  # the url's fsspec package (gcsfs, s3fs ...) is not installed
        raise ValueError(f"data.train source {spec!r}: {e}") from None
    except Exception as e:
        if not (is_local(sizes_url) or missing_object(e)) or not isinstance(e, (OSError, ValueError)):
            raise FileNotFoundError(
                f"data.train source {spec!r}: cannot read {sizes_url}: {describe(e)}. Check the url, the "
                "credentials (AWS_* variables, a profile) and data.remote.storage_options (an endpoint_url)"
            ) from None
        raise FileNotFoundError(
            f"data.train source {spec!r}: no sample counts ({sizes_url}: {e.__class__.__name__}). Exact epochs "
            "and resume need them: put a sizes.json (shard file name -> samples) beside the shards, or give a "
            "dataset folder written by `python -m data_tools build`"
        ) from None
    return check_sizes(sizes, sizes_url)


def _read_manifest_near(urls: list[str], remote: RemoteConfig | None) -> dict[str, Any]:
    """The manifest beside a pattern's shards; {} when there is none (it is optional there)."""
    try:
        data = _read_json(_near(urls, MANIFEST), remote)
    except Exception:  # optional; sizes.json, read first, reports an unreachable store
        return {}
    return data if isinstance(data, dict) else {}


def resolve_source(spec: str, weight: float = 1.0, remote: RemoteConfig | None = None) -> Source:
    p = Path(spec.removeprefix("file://"))
    if is_local(spec.removeprefix("file://")) and p.is_dir():
        sizes = read_sizes(p)
        names = sorted(sizes)
        missing = [n for n in names if not (p / n).is_file()]
        if missing:
            raise FileNotFoundError(f"data.train: {p / missing[0]} is listed in sizes.json but missing "
                                    f"({len(missing)} missing); rebuild or fix sizes.json")
        return Source(spec, [str(p / n) for n in names], [int(sizes[n]) for n in names], weight, read_manifest(p),
                      remote=remote)
    urls = list(braceexpand(spec))
    local = [u for u in urls if not u.startswith("pipe:") and is_local(u.removeprefix("file://"))]
    missing = [u for u in local if not Path(u.removeprefix("file://")).is_file()]
    if missing and any(c in spec for c in "*?["):
        raise FileNotFoundError(f"data.train: {spec} holds a glob pattern, which is not expanded: name shards with "
                                "braces (shards/train-{000000..000099}.tar) or give the dataset folder (with "
                                "sizes.json)")
    if missing:
        raise FileNotFoundError(f"data.train: shard {missing[0]} does not exist ({len(missing)} missing)")
    sizes = _read_sizes_near(urls, spec, remote)
    names = [posixpath.basename(shard_path(u)) for u in urls]
    unknown = [n for n in names if n not in sizes]
    if unknown:
        raise FileNotFoundError(f"data.train source {spec!r}: {unknown[0]} is not in the sizes.json beside it "
                                f"({len(unknown)} shard(s) without a count)")
    return Source(spec, urls, [int(sizes[n]) for n in names], weight, _read_manifest_near(urls, remote), remote=remote)


def resolve_sources(spec: str, weights: list[float] | None = None, remote: RemoteConfig | None = None) -> list[Source]:
    """``data.train``'s sources; ``remote``: the options (``data.remote``) their remote files are read with,
    carried by each source to every later read of its shards and the files beside them."""
    parts = [s for s in spec.split("::") if s.strip()]
    if not parts:
        raise FileNotFoundError(f"data.train={spec!r} names no shards")
    if weights is not None and len(weights) != len(parts):
        raise ValueError(f"data.weights has {len(weights)} value(s) for {len(parts)} source(s) in data.train "
                         "(one weight per '::'-separated source)")
    sources = [resolve_source(s.strip(), (weights or [1.0] * len(parts))[i], remote) for i, s in enumerate(parts)]
    for s in sources:
        if s.num_samples == 0:
            raise ValueError(f"data.train source {s.spec!r} has no samples (sizes.json counts are all 0)")
    return sources
