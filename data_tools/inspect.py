"""``verify DIR`` and ``stats DIR``: read every sample back and check it against the manifest."""

from __future__ import annotations

import io
import json
from collections import Counter
from pathlib import Path

import numpy as np
from PIL import Image

from data_tools.embed import dataset_folders
from mmpretrain.data.manifest import read_manifest, read_sizes
from mmpretrain.data.shards import IMAGE_EXTS, iter_samples


def verify_folder(folder: Path, strict: bool = False) -> list[str]:
    """Problems found in one dataset folder (empty list = valid)."""
    problems: list[str] = []
    sizes = read_sizes(folder)
    manifest = read_manifest(folder)
    emb = manifest.get("embedding") or {}
    for name, expected in sorted(sizes.items()):
        path = folder / name
        if not path.is_file():
            problems.append(f"{path}: listed in sizes.json but missing")
            continue
        count = 0
        try:
            for s in iter_samples(path):
                count += 1
                key = f"{path}:{s['__key__']}"
                ext = next((e for e in IMAGE_EXTS if e in s), None)
                if ext is None:
                    problems.append(f"{key}: no image member")
                else:
                    try:
                        Image.open(io.BytesIO(s[ext])).load()
                    except Exception as e:
                        problems.append(f"{key}: image does not decode ({e.__class__.__name__})")
                try:
                    if not s.get("txt", b"").decode("utf-8").strip():
                        problems.append(f"{key}: empty or missing caption")
                except UnicodeDecodeError:
                    problems.append(f"{key}: caption is not UTF-8")
                if "json" in s:
                    try:
                        json.loads(s["json"])
                    except ValueError:
                        problems.append(f"{key}: json member does not parse")
                if emb:
                    if "emb.npy" not in s:
                        if strict or name in emb.get("shards", []):
                            problems.append(f"{key}: no emb.npy although the manifest records embeddings")
                    else:
                        v = np.load(io.BytesIO(s["emb.npy"]))
                        if v.dtype != np.float16 or v.shape != (emb["dim"],):
                            problems.append(f"{key}: emb.npy is {v.dtype}{v.shape}, expected float16({emb['dim']},)")
                        elif abs(float(np.linalg.norm(v.astype(np.float32))) - 1) > 1e-2:
                            problems.append(f"{key}: emb.npy is not L2-normalised")
        except Exception as e:
            problems.append(f"{path}: unreadable tar ({e})")
        if count != expected:
            problems.append(f"{path}: {count} samples, sizes.json says {expected}")
    return problems


def verify(path: str | Path, strict: bool = False) -> dict[str, list[str]]:
    return {str(f): verify_folder(f, strict) for f in dataset_folders(path)}


def stats_folder(folder: Path) -> dict:
    sizes = read_sizes(folder)
    words, widths, heights, labels = [], [], [], Counter()
    with_emb = 0
    for name in sorted(sizes):
        for s in iter_samples(folder / name):
            words.append(len(s.get("txt", b"").decode("utf-8", "replace").split()))
            if "json" in s:
                meta = json.loads(s["json"])
                widths.append(meta.get("width", 0))
                heights.append(meta.get("height", 0))
                if "label_name" in meta:
                    labels[meta["label_name"]] += 1
            with_emb += "emb.npy" in s
    n = len(words)

    def summary(xs):
        return {"min": int(min(xs)), "mean": round(float(np.mean(xs)), 2), "max": int(max(xs))} if xs else None

    return {
        "folder": str(folder),
        "samples": n,
        "shards": len(sizes),
        "caption_words": summary(words),
        "image_width": summary(widths),
        "image_height": summary(heights),
        "with_embedding": with_emb,
        "labels": dict(labels.most_common()),
        "skipped_at_build": read_manifest(folder).get("skipped", {}),
    }


def stats(path: str | Path) -> list[dict]:
    return [stats_folder(f) for f in dataset_folders(path)]
