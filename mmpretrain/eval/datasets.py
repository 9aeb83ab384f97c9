"""Evaluation datasets: clip_benchmark's offline ``wds`` layout and this project's own shards.

``SPEC`` is a folder: one with ``classnames.txt`` and ``test/nshards.txt`` is read as clip_benchmark's
layout (``wds:DIR`` forces it); one with ``sizes.json`` as our shards (``shards:DIR`` forces it), with
captions from ``txt`` and labels from ``json`` (``label``), class names from the manifest.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from mmpretrain.data.manifest import read_manifest, read_sizes
from mmpretrain.data.shards import IMAGE_EXTS, iter_samples


@dataclass
class EvalSample:
    key: str
    image: Image.Image
    captions: list[str]
    label: int | None


@dataclass
class EvalDataset:
    name: str
    shards: list[Path]
    classnames: list[str] | None
    templates: list[str] | None
    layout: str  # "wds" or "shards"

    def __iter__(self) -> Iterator[EvalSample]:
        for shard in self.shards:
            for raw in iter_samples(shard):
                ext = next((e for e in IMAGE_EXTS if e in raw), None)
                if ext is None:
                    continue
                image = Image.open(io.BytesIO(raw[ext])).convert("RGB")
                captions = []
                if "txt" in raw:
                    captions = [c for c in raw["txt"].decode("utf-8").split("\n") if c.strip()]
                label = None
                if "cls" in raw:
                    label = int(raw["cls"].decode().strip())
                elif "json" in raw:
                    label = json.loads(raw["json"]).get("label")
                yield EvalSample(raw["__key__"], image, captions, label)


def _read_lines(p: Path) -> list[str]:
    return [line.strip() for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]


def load_dataset(spec: str, name: str | None = None) -> EvalDataset:
    kind = None
    for prefix in ("wds:", "shards:"):
        if spec.startswith(prefix):
            kind, spec = prefix[:-1], spec[len(prefix):]
    root = Path(spec)
    if not root.is_dir():
        raise FileNotFoundError(f"--dataset {spec}: no such folder")
    if kind is None:
        kind = "wds" if (root / "classnames.txt").is_file() and (root / "test" / "nshards.txt").is_file() else (
            "shards" if (root / "sizes.json").is_file() else None)
    if kind == "wds":
        n = int((root / "test" / "nshards.txt").read_text().strip())
        templates_file = root / "zeroshot_classification_templates.txt"
        return EvalDataset(
            name=name or f"{root.resolve().name}-test",
            shards=[root / "test" / f"{i}.tar" for i in range(n)],
            classnames=_read_lines(root / "classnames.txt"),
            templates=_read_lines(templates_file) if templates_file.is_file() else None,
            layout="wds",
        )
    if kind == "shards":
        manifest = read_manifest(root)
        return EvalDataset(
            name=name or f"{root.resolve().parent.name}-{root.resolve().name}",
            shards=[root / s for s in sorted(read_sizes(root))],
            classnames=manifest.get("classnames"),
            templates=None,
            layout="shards",
        )
    raise FileNotFoundError(
        f"--dataset {spec}: neither clip_benchmark's wds layout (classnames.txt + test/nshards.txt) nor a "
        "shard folder (sizes.json)"
    )
