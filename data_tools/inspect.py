"""``verify DIR`` and ``stats DIR``: read every sample back and check it against the manifest."""

from __future__ import annotations

import io
import json
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
from PIL import Image

from data_tools.embed import dataset_folders, embedding_folders
from mmpretrain.data.decode import IMAGE_EXTS
from mmpretrain.data.manifest import read_manifest, read_sizes
from mmpretrain.data.sidecar import EMB_SUFFIX, IN_TAR, INDEX, LAYOUT, SourceEmbeddings, read_index, read_row
from mmpretrain.data.tar import UNREADABLE, read_tar
from mmpretrain.data.teacher import SourceTeachers, read_teachers

# problems that make the folder unusable as listed (exit 1 even without --strict)
FATAL = {"missing_shard", "unreadable_tar", "count_mismatch"}


def sidecars(folder: Path, emb_dir: str | Path | None) -> SourceEmbeddings | None:
    """The embedding folder to check with ``folder``: ``emb_dir``, else the folder itself when it holds
    an ``embeddings.json``."""
    index = read_index(str(emb_dir or folder))
    if emb_dir is not None and index is None and read_teachers(str(emb_dir)) is None:
        raise FileNotFoundError(f"--embeddings {emb_dir}: no readable {INDEX} in it")
    return SourceEmbeddings(str(emb_dir or folder), index) if index else None


def verify_folder(folder: Path, emb_dir: str | Path | None = None) -> dict[str, list[str]]:
    """Problems found in one dataset folder (and its caption embeddings), by kind (empty = valid)."""
    problems: dict[str, list[str]] = defaultdict(list)
    sizes = read_sizes(folder)
    side = sidecars(folder, emb_dir)
    emb = {} if side else read_manifest(folder).get("embedding") or {}  # in-tar embeddings to check
    if emb.get("layout") == LAYOUT:  # recorded beside the shards, but not there: said once, not per sample
        problems["missing_embedding_files"].append(
            f"{folder}: the manifest records embeddings beside the shards, but there is no {INDEX} and no "
            f"{next(iter(sorted(sizes)), 'NAME.tar')}{EMB_SUFFIX} (shards copied without them?): embed them "
            f"(`python -m data_tools embed {folder} --model {emb.get('model', 'MODEL')}`), or check the folder "
            "they were written to with --embeddings EMB_DIR (data.embeddings=EMB_DIR in training)")
        emb = {}
    seen: dict[str, str] = {}
    index = read_teachers(str(emb_dir or folder))  # teacher rows (embed --image-model), checked the same way
    teachers = SourceTeachers(str(emb_dir or folder), index, list(index["teachers"])) if index else None
    for name, expected in sorted(sizes.items()):
        path = folder / name
        if not path.is_file():
            problems["missing_shard"].append(f"{path}: listed in sizes.json but missing")
            continue
        rows = side.for_shard(str(path), expected) if side else None
        if rows is not None and rows.reason:
            problems["bad_embedding_file"].append(f"{rows.where}: {rows.reason}")
        trows = teachers.for_shard(str(path), expected) if teachers else None
        if trows is not None and trows.reason:
            problems["bad_teacher_file"].append(f"{trows.where}: {trows.reason}")
        count = 0
        try:
            for s in read_tar(path):
                if rows is not None and rows.rows is not None:
                    _check_row(rows, count, s["__key__"], path, problems)
                if trows is not None and not trows.reason and trows.rows(count, s["__key__"]) is None:
                    problems["missing_teacher"].append(f"{path.name}:{s['__key__']}: the teacher rows' key at "
                                                       f"position {count} is {trows.keys[count:count + 1]}")
                count += 1
                _check_sample(s, path, emb, seen, problems)
        except UNREADABLE as e:
            problems["unreadable_tar"].append(f"{path}: {e.__class__.__name__}: {e} (after {count} samples)")
        if count != expected:
            problems["count_mismatch"].append(f"{path}: {count} samples, sizes.json says {expected}")
    return dict(problems)


def _check_row(rows, pos: int, key: str, path: Path, problems: dict[str, list[str]]) -> None:
    v = rows.row(pos, key)
    if v is None:
        problems["missing_embedding"].append(f"{path.name}:{key}: the sidecar's key at position {pos} is "
                                             f"{rows.keys[pos] if pos < len(rows.keys) else None!r}")
    elif np.isfinite(v).all() and abs(float(np.linalg.norm(v.astype(np.float32))) - 1) > 1e-2:
        problems["bad_embedding"].append(f"{path.name}:{key}: not L2-normalised")


def _check_sample(s: dict, path: Path, emb: dict, seen: dict[str, str], problems: dict[str, list[str]]) -> None:
    key = f"{path.name}:{s['__key__']}"
    if s["__key__"] in seen:
        problems["duplicate_key"].append(f"{key}: also in {seen[s['__key__']]}")
    seen.setdefault(s["__key__"], path.name)
    ext = next((e for e in IMAGE_EXTS if e in s), None)
    if ext is None:
        problems["missing_image"].append(f"{key}: no image member")
    else:
        try:
            Image.open(io.BytesIO(s[ext])).load()
        except Exception as e:
            problems["undecodable_image"].append(f"{key}: {e.__class__.__name__}")
    try:
        if "txt" not in s:
            problems["missing_caption"].append(f"{key}: no txt member")
        elif not s["txt"].decode("utf-8").strip():
            problems["empty_caption"].append(f"{key}: empty caption")
    except UnicodeDecodeError:
        problems["caption_not_utf8"].append(f"{key}: caption is not UTF-8")
    if "json" in s:
        try:
            json.loads(s["json"])
        except ValueError:
            problems["bad_json"].append(f"{key}: json member does not parse")
    if emb:
        if IN_TAR not in s:
            problems["missing_embedding"].append(f"{key}: no {IN_TAR} but the manifest records in-tar embeddings")
        else:
            try:
                v = read_row(s[IN_TAR])
            except (ValueError, EOFError, OSError) as e:
                problems["bad_embedding"].append(f"{key}: {e.__class__.__name__}: {e}")
                return
            if v.dtype != np.float16 or v.shape != (emb["dim"],):
                problems["bad_embedding"].append(f"{key}: {v.dtype}{v.shape}, expected float16({emb['dim']},)")
            elif abs(float(np.linalg.norm(v.astype(np.float32))) - 1) > 1e-2:
                problems["bad_embedding"].append(f"{key}: not L2-normalised")


def verify(path: str | Path, embeddings: str | Path | None = None) -> dict[str, dict[str, list[str]]]:
    """Every dataset folder under ``path``; ``embeddings``: the embedding folder (``embed --out``; with
    several split folders, one subfolder each), default: beside the shards."""
    folders = dataset_folders(path)
    return {str(f): verify_folder(f, e) for f, e in zip(folders, embedding_folders(folders, embeddings))}


def stats_folder(folder: Path, plot: bool = True, emb_dir: str | Path | None = None) -> dict:
    sizes = read_sizes(folder)
    side = sidecars(folder, emb_dir)
    words, widths, heights, labels = [], [], [], Counter()
    with_emb = 0
    unreadable = []
    for name in sorted(sizes):
        try:
            for s in read_tar(folder / name):
                words.append(len(s.get("txt", b"").decode("utf-8", "replace").split()))
                try:
                    meta = json.loads(s["json"]) if "json" in s else None
                except ValueError:
                    meta = None
                if isinstance(meta, dict):
                    widths.append(meta.get("width", 0))
                    heights.append(meta.get("height", 0))
                    if "label_name" in meta:
                        labels[meta["label_name"]] += 1
                with_emb += IN_TAR in s
        except UNREADABLE as e:  # counted up to the damage; `verify` tells the whole story
            unreadable.append(f"{name}: {e.__class__.__name__}: {e}")

    def summary(xs):
        if not xs:
            return None
        q = np.percentile(xs, [5, 50, 95])
        return {"min": int(min(xs)), "p5": float(q[0]), "median": float(q[1]), "mean": round(float(np.mean(xs)), 2),
                "p95": float(q[2]), "max": int(max(xs))}

    if side is not None:  # rows of the sidecar files that match their shard
        with_emb += sum(int(r.get("count", 0)) for n, r in side.index["shards"].items()
                        if n in sizes and not side.for_shard(str(folder / n), sizes[n]).reason)
    out = {
        "folder": str(folder),
        "samples": len(words),
        "shards": len(sizes),
        "caption_words": summary(words),
        "image_width": summary(widths),
        "image_height": summary(heights),
        "with_embedding": with_emb,
        "labels": dict(labels.most_common()),
        "skipped_at_build": read_manifest(folder).get("skipped", {}),
    }
    if unreadable:
        out["unreadable_shards"] = unreadable
    if plot and words:
        out["plot"] = str(_plot(folder, words, widths, heights))
    return out


def _plot(folder: Path, words: list[int], widths: list[int], heights: list[int]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    axes[0].hist(words, bins=range(0, max(words) + 2))
    axes[0].set_xlabel("caption length (words)")
    axes[0].set_ylabel("samples")
    if widths:
        axes[1].scatter(widths, heights, s=4, alpha=0.5)
    axes[1].set_xlabel("image width (px)")
    axes[1].set_ylabel("image height (px)")
    fig.suptitle(folder.name)
    fig.tight_layout()
    path = folder / "stats.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def keep_stats(folder: Path, keep: str) -> dict | None:
    """A keep-list's counts for the dataset folder it was made for (None for another folder)."""
    from mmpretrain.data.keep import read_list

    index = read_list(keep)
    sizes = read_sizes(folder)
    if not set(index["shards"]) <= set(sizes):
        return None
    return {"list": str(keep), "kept": index["kept"], "total": index["total"], "removed": index["removed"],
            "rules": [{k: r.get(k) for k in ("rule", "reached", "removed")} for r in index["rules"]],
            "kept_per_shard": {n: r["kept"] for n, r in sorted(index["shards"].items())}}


def stats(path: str | Path, embeddings: str | Path | None = None, keep: str | None = None) -> list[dict]:
    folders = dataset_folders(path)
    out = [stats_folder(f, emb_dir=e) for f, e in zip(folders, embedding_folders(folders, embeddings))]
    if keep:
        matched = [(o, keep_stats(f, keep)) for o, f in zip(out, folders)]
        if not any(k for _, k in matched):
            raise ValueError(f"--keep {keep}: the keep-list names shards none of {[str(f) for f in folders]} has; give "
                             "the list made for this data")
        for o, k in matched:
            if k:
                o["keep"] = k
    return out
