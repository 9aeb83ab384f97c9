"""``embed SHARDS --model NAME_OR_PATH [--out EMB_DIR]``: each caption's frozen embedding, stored
**beside** the shards (:mod:`mmpretrain.data.sidecar`: ``EMB_DIR/NAME.tar.emb.npy`` float16
L2-normalised rows in the shard's sample order, ``NAME.tar.keys.txt``, one ``embeddings.json``).

No tar is ever written: the shards may be read-only or remote. ``EMB_DIR`` defaults to the dataset
folder (when it is local); with several split folders (``train/``, ``test/``) ``--out`` gets one
subfolder each. Every file is written through a temporary file and a rename; a re-run skips shards
already embedded with the same model whose shard is unchanged (``EMB_DIR/.embed/NAME.tar.json``:
model, count, first key, the shard's size and time). Under ``accelerate launch`` each rank embeds
every world-th shard; rank 0 writes ``embeddings.json`` (and, when ``EMB_DIR`` is the dataset folder,
the manifest's ``embedding`` record).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from mmpretrain.data.manifest import MANIFEST, SIZES, read_manifest, write_json_atomic
from mmpretrain.data.sidecar import (
    EXTRA_SUFFIXES,
    INDEX,
    LAYOUT,
    SUFFIXES,
    VERSION,
    read_index,
    shard_bytes,
    write_shard,
)
from mmpretrain.data.sources import Source, resolve_source
from mmpretrain.data.tar import UNREADABLE, read_tar
from mmpretrain.data.urls import shard_path
from mmpretrain.hub_cache import local_only, quiet_load, require_model
from mmpretrain.process import current_process

MARKERS = ".embed"  # per-shard completion records


class EmbedError(RuntimeError):
    """A request that cannot start (exit code 2)."""


def dataset_folders(path: str | Path) -> list[Path]:
    """``path`` itself if it is a dataset folder, else its split subfolders (``train/``, ``test/``)."""
    path = Path(path)
    if (path / SIZES).is_file():
        return [path]
    subs = sorted(p.parent for p in path.glob(f"*/{SIZES}"))
    if not subs:
        raise EmbedError(f"{path} holds no dataset: no {SIZES} in it or in its subfolders")
    return subs


def _load_encoder(model: str, device: str | None):
    from sentence_transformers import SentenceTransformer

    with quiet_load():
        enc = SentenceTransformer(str(model), device=device, **local_only())
    if enc.device.type == "cuda":
        enc = enc.half()
    return enc


def embedding_folders(folders: list[Path], out: str | Path | None) -> list[Path | None]:
    """Where each dataset folder's embeddings are given ``--out`` (or ``--embeddings``): that folder,
    with several split folders a subfolder each; None without it (beside the shards)."""
    if out is None:
        return [None] * len(folders)
    return [Path(out) / f.name if len(folders) > 1 else Path(out) for f in folders]


def embed_jobs(path: str, out: str | Path | None) -> list[tuple[Source, Path, Path | None]]:
    """``(source, embedding folder, dataset folder or None)`` for each dataset ``path`` names: a local
    dataset folder or a folder of split folders, or a shard pattern (local or remote; needs ``--out``
    unless its folder is local)."""
    local = Path(path.removeprefix("file://"))
    if "://" not in path and not path.startswith("pipe:") and not any(c in path for c in "{*?[") \
            and not local.exists():
        raise EmbedError(f"{path}: no such dataset folder or shard")
    try:
        if local.is_dir():
            folders = dataset_folders(local)
            return [(resolve_source(str(f)), e or f, f) for f, e in zip(folders, embedding_folders(folders, out))]
        source = resolve_source(path)
    except (FileNotFoundError, ValueError) as e:
        raise EmbedError(str(e)) from None
    folder = Path(os.path.dirname(shard_path(source.urls[0])))
    if out is None and not folder.is_dir():
        raise EmbedError(f"{path}: the shards are not in a local folder; give --out EMB_DIR for the embeddings")
    return [(source, Path(out) if out else folder, None)]


def check_model(emb_dir: Path, dataset: Path | None, model: str, overwrite: bool) -> None:
    if (emb_dir / INDEX).exists() and read_index(str(emb_dir)) is None:
        raise EmbedError(f"{emb_dir / INDEX} exists and is not an index embed wrote (no 'shards' record): it is "
                         "left as it is; choose another --out")
    index = read_index(str(emb_dir)) or {}
    recorded = index.get("model") or (
        (read_manifest(dataset).get("embedding") or {}).get("model") if dataset == emb_dir else None)
    if recorded and recorded != model and not overwrite:
        where = emb_dir / (INDEX if index else MANIFEST)
        raise EmbedError(f"{where} records embeddings from {recorded!r}; embedding with {model!r} would mix "
                         "two spaces. Pass --overwrite to replace them")


def _marker(emb_dir: Path, name: str) -> Path:
    return emb_dir / MARKERS / (name + ".json")


def _fingerprint(url: str) -> dict:
    path = url.removeprefix("file://")
    mtime = os.stat(path).st_mtime_ns if os.path.isfile(path) else None
    return {"bytes": shard_bytes(url), "mtime_ns": mtime}


def _shard_done(emb_dir: Path, url: str, model: str) -> dict | None:
    """The shard's completion record if it was embedded with ``model`` into ``emb_dir`` and is still the
    shard that was embedded (a rebuilt shard has another size or time) and its files are there."""
    name = os.path.basename(shard_path(url))
    try:
        done = json.loads(_marker(emb_dir, name).read_text())
    except (OSError, ValueError):
        return None
    fresh = done.get("model") == model and {k: done.get(k) for k in ("bytes", "mtime_ns")} == _fingerprint(url)
    fresh = fresh and "extra" in done  # a shard embedded before the extra captions were read: again
    files = all((emb_dir / (name + s)).is_file() for s in SUFFIXES + (EXTRA_SUFFIXES if done.get("extra") else ()))
    return done if fresh and files else None


def _extra_captions(data: bytes | None) -> list[str]:
    """The extra captions of a sample's ``json`` member (``captions``: a list of strings), as training
    reads them (:func:`mmpretrain.data.decode.caption_pool`); [] when there are none or they are unusable
    (training skips such a sample as ``bad_captions``)."""
    from mmpretrain.data.decode import SkipSample, caption_pool

    try:
        return caption_pool({"json": data} if data is not None else {})[0]
    except SkipSample:
        return []


def _read_captions(url: str, expected: int) -> tuple[list[str], list[str | None], list[list[str]]]:
    """The shard's keys, captions and extra captions in sample order (only ``txt`` and ``json`` are read)."""
    keys, captions, extra = [], [], []
    try:
        for s in read_tar(url, only=("txt", "json")):
            keys.append(s["__key__"])
            try:
                captions.append(s["txt"].decode("utf-8") if "txt" in s else None)
            except UnicodeDecodeError:
                captions.append(None)
            extra.append(_extra_captions(s.get("json")))
    except UNREADABLE as e:
        raise EmbedError(f"{url}: unreadable after {len(keys)} samples ({e.__class__.__name__}: {e}); "
                         "run `data_tools verify` and rebuild the shard") from None
    if len(keys) != expected:
        raise EmbedError(f"{url}: {len(keys)} samples, sizes.json says {expected}; run `data_tools verify` "
                         "and rebuild the shard or its sizes.json")
    return keys, captions, extra


def embed_shards(source: Source, emb_dir: Path, todo: list[int], model: str, encoder, batch_size: int,
                 group: int = 8192) -> int:
    """Embed the source's shards ``todo`` (indices) in groups of about ``group`` captions: one ``encode``
    call per group (so sentence-transformers sorts a large set by length, as one call over everything
    would), with the next group read and the previous one written by a background thread meanwhile."""
    from concurrent.futures import ThreadPoolExecutor

    groups, cur, n = [], [], 0
    for k in todo:
        cur.append(k)
        n += source.sizes[k]
        if n >= group:
            groups.append(cur)
            cur, n = [], 0
    if cur:
        groups.append(cur)
    if not groups:
        return 0
    (emb_dir / MARKERS).mkdir(parents=True, exist_ok=True)

    def read(g):
        return [(source.urls[k], *_read_captions(source.urls[k], source.sizes[k])) for k in g]

    def write(shards, embs, extra_embs):
        i = j = 0
        for url, keys, captions, extra in shards:
            rows = embs[i:i + len(keys)]
            i += len(keys)
            offsets = np.cumsum([0] + [len(e) for e in extra])
            n_extra = int(offsets[-1])
            side = (extra_embs[j:j + n_extra], offsets) if n_extra else None
            j += n_extra
            name = os.path.basename(shard_path(url))
            write_shard(emb_dir, name, keys, rows, side)
            write_json_atomic(_marker(emb_dir, name), {
                "model": model, "dim": int(rows.shape[1]), "count": len(keys), "first_key": keys[0] if keys else None,
                "no_caption": sum(c is None for c in captions), "extra": n_extra, **_fingerprint(url)})

    total = 0
    with ThreadPoolExecutor(max_workers=2) as io_pool:
        next_read = io_pool.submit(read, groups[0])
        pending = None
        for k in range(len(groups)):
            shards = next_read.result()
            if k + 1 < len(groups):
                next_read = io_pool.submit(read, groups[k + 1])
            captions = [c for _, _, caps, _ in shards for c in caps]
            present = [c for c in captions if c is not None]
            extras = [c for _, _, _, ex in shards for e in ex for c in e]
            # one encode call for caption 0 and the extra captions: sentence-transformers sorts them by length
            enc_all = encoder.encode(present + extras, batch_size=batch_size, normalize_embeddings=True,
                                     convert_to_numpy=True)
            enc, extra_embs = enc_all[:len(present)], enc_all[len(present):].astype(np.float16)
            # a sample without a caption keeps its row (rows follow the shard's order) as NaN: the
            # stream skips it for its missing caption before it would read the row
            embs = np.full((len(captions), enc.shape[1]), np.nan, dtype=np.float16)
            embs[[j for j, c in enumerate(captions) if c is not None]] = enc.astype(np.float16)
            if pending is not None:
                pending.result()
            pending = io_pool.submit(write, shards, embs, extra_embs)
            total += len(present) + len(extras)
        pending.result()
    return total


def embed(path: str | Path, model: str, *, out: str | Path | None = None, overwrite: bool = False,
          batch_size: int = 256, device: str | None = None) -> list[dict]:
    """Embed every dataset ``path`` names into its embedding folder (``out``, default: the dataset
    folder); under ``accelerate launch`` each rank takes every world-th shard. A re-run skips shards
    already embedded with ``model``; ``overwrite`` embeds every shard again (and may change the model)."""
    jobs = embed_jobs(str(path), out)
    for _, emb_dir, dataset in jobs:  # refuse before loading anything
        check_model(emb_dir, dataset, model, overwrite)
        for p in (emb_dir, *emb_dir.parents):
            if p.exists() and not p.is_dir():
                raise EmbedError(f"--out {out or emb_dir}: {p} is a file, not a folder")
        existing = next(p for p in (emb_dir, *emb_dir.parents) if p.exists())
        if not os.access(existing, os.W_OK):
            raise EmbedError(f"{existing} is not writable{'' if out else ' (the shards may be read-only)'}: give "
                             "--out EMB_DIR, a folder for the embeddings (training takes it as data.embeddings)")
    try:  # a misspelt --model is refused before anything is written
        require_model(model, "--model")
    except ValueError as e:
        raise EmbedError(str(e)) from None
    proc = current_process()
    rank, world = proc.rank, proc.world_size
    encoder = None
    results = []
    for source, emb_dir, _ in jobs:
        todo = [k for k, url in enumerate(source.urls)
                if k % world == rank and (overwrite or not _shard_done(emb_dir, url, model))]
        if todo and encoder is None:
            encoder = _load_encoder(model, device or proc.device)
        n = embed_shards(source, emb_dir, todo, model, encoder, batch_size)
        results.append({"folder": str(emb_dir), "embedded": n, "shards": len(todo)})
    proc.barrier()
    if rank == 0:
        for (source, emb_dir, dataset), res in zip(jobs, results):
            records = [_shard_done(emb_dir, url, model) for url in source.urls]
            if not all(records):
                raise EmbedError(f"{emb_dir}: {records.count(None)} shard(s) not embedded; run embed again")
            dim = records[0]["dim"]
            index = {"version": VERSION, "model": model, "dim": dim, "normalized": True, "dtype": "float16",
                     "count": sum(r["count"] for r in records), "extra_captions": sum(r["extra"] for r in records),
                     "shards": {os.path.basename(shard_path(url)): {k: r[k] for k in ("count", "bytes", "first_key",
                                                                                     "extra")}
                                for url, r in zip(source.urls, records)}}
            write_json_atomic(emb_dir / INDEX, index)
            if dataset is not None and dataset == emb_dir:  # our own dataset folder: its manifest says so too
                manifest = read_manifest(dataset)
                manifest["embedding"] = {k: index[k] for k in ("model", "dim", "normalized", "dtype", "count")}
                manifest["embedding"]["layout"] = LAYOUT
                write_json_atomic(dataset / MANIFEST, manifest)
            res["dim"] = dim
    proc.barrier()
    return results
