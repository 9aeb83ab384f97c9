"""``embed DIR --model NAME_OR_PATH``: store each caption's frozen embedding as ``{key}.emb.npy``.

float16, L2-normalised, shape ``(E,)``. Each shard is rewritten through a temporary file and an
atomic rename, so an interrupted run leaves every shard either old or new, never half-written; a
re-run skips shards already embedded with the same model (``.embed/SHARD.json``). Under
``accelerate launch`` each rank embeds every world-th shard; rank 0 records the result in the manifest.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np
import webdataset as wds

from mmpretrain.data.manifest import MANIFEST, SIZES, read_manifest, read_sizes, write_json_atomic
from mmpretrain.data.tar import UNREADABLE, read_tar
from mmpretrain.hub_cache import require_model
from mmpretrain.launch import current_process

MARKERS = ".embed"  # per-shard completion records: {model, dim, count}


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

    enc = SentenceTransformer(str(model), device=device)
    if enc.device.type == "cuda":
        enc = enc.half()
    return enc


def check_model(folder: Path, model: str, overwrite: bool) -> None:
    recorded = (read_manifest(folder).get("embedding") or {}).get("model")
    if recorded and recorded != model and not overwrite:
        raise EmbedError(
            f"{folder / MANIFEST} records embeddings from {recorded!r}; embedding with {model!r} would mix "
            "two spaces. Pass --overwrite to replace them"
        )


def _marker(folder: Path, shard: str) -> Path:
    return folder / MARKERS / (shard + ".json")


def _fingerprint(path: Path) -> dict:
    st = path.stat()
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def _shard_done(folder: Path, shard: str, model: str) -> bool:
    """Embedded with ``model`` -- and the shard is still the one that was embedded (a rebuilt or replaced
    shard has another size or time: its marker is stale)."""
    p, shard_path = _marker(folder, shard), folder / shard
    if not p.is_file() or not shard_path.is_file():
        return False
    try:
        done = json.loads(p.read_text())
    except ValueError:
        return False
    return done.get("model") == model and {k: done.get(k) for k in ("bytes", "mtime_ns")} == _fingerprint(shard_path)


def _read_shard(folder: Path, name: str, expected: int) -> tuple[list[dict], list[str]]:
    """The shard's samples (members copied through untouched, any old embedding dropped) and their
    captions in sample order."""
    samples, captions = [], []
    try:
        for s in read_tar(folder / name):
            s.pop("emb.npy", None)  # replaced
            samples.append(s)
            captions.append(s["txt"].decode("utf-8") if "txt" in s else None)
    except UNREADABLE as e:
        raise EmbedError(f"{folder / name}: unreadable after {len(samples)} samples ({e.__class__.__name__}: {e}); "
                         "run `data_tools verify` and rebuild the shard") from None
    if len(samples) != expected or any(c is None for c in captions):
        raise EmbedError(f"{folder / name}: {len(samples)} samples ({sum(c is None for c in captions)} without a "
                         f"caption), sizes.json says {expected}; run `data_tools verify` and rebuild the shard")
    return samples, captions


def _write_shard(folder: Path, name: str, model: str, samples: list[dict], embs: np.ndarray) -> int:
    """Rewrite one shard with ``{key}.emb.npy`` in each sample (webdataset's writer, through .tmp + rename)."""
    tmp = folder / (name + ".tmp")
    with wds.TarWriter(str(tmp), encoder=False) as out:
        for s, e in zip(samples, embs):
            buf = io.BytesIO()
            np.save(buf, e)
            out.write({**s, "emb.npy": buf.getvalue()})
    os.replace(tmp, folder / name)
    write_json_atomic(_marker(folder, name), {"model": model, "dim": int(embs.shape[1]), "count": len(samples),
                                              **_fingerprint(folder / name)})
    return len(samples)


def embed_shards(folder: Path, names: list[str], sizes: dict[str, int], model: str, encoder, batch_size: int,
                 group: int = 8192) -> int:
    """Embed shards in groups of about ``group`` captions: one ``encode`` call per group (so
    sentence-transformers sorts a large set by length, as a single call over everything would), with
    the next group read and the previous one written by a background thread while it encodes."""
    from concurrent.futures import ThreadPoolExecutor

    groups, cur, n = [], [], 0
    for name in names:
        cur.append(name)
        n += sizes[name]
        if n >= group:
            groups.append(cur)
            cur, n = [], 0
    if cur:
        groups.append(cur)
    if not groups:
        return 0

    def read(g):
        return [(name, *_read_shard(folder, name, sizes[name])) for name in g]

    def write(shards, embs):
        i = 0
        for name, samples, captions in shards:
            _write_shard(folder, name, model, samples, embs[i:i + len(captions)])
            i += len(captions)

    total = 0
    with ThreadPoolExecutor(max_workers=2) as io_pool:
        next_read = io_pool.submit(read, groups[0])
        pending = None
        for k in range(len(groups)):
            shards = next_read.result()
            if k + 1 < len(groups):
                next_read = io_pool.submit(read, groups[k + 1])
            captions = [c for _, _, caps in shards for c in caps]
            embs = encoder.encode(captions, batch_size=batch_size, normalize_embeddings=True,
                                  convert_to_numpy=True).astype(np.float16)
            if pending is not None:
                pending.result()
            pending = io_pool.submit(write, shards, embs)
            total += len(captions)
        pending.result()
    return total


def embed(path: str | Path, model: str, *, overwrite: bool = False, batch_size: int = 256,
          device: str | None = None) -> list[dict]:
    """Embed every dataset folder under ``path``; under ``accelerate launch`` each rank takes every
    world-th shard. A re-run skips shards already embedded with ``model``."""
    folders = dataset_folders(path)
    for folder in folders:  # refuse before loading anything
        check_model(folder, model, overwrite)
    try:  # before --overwrite drops the earlier records: a misspelt --model must not cost them
        require_model(model, "--model")
    except ValueError as e:
        raise EmbedError(str(e)) from None
    proc = current_process()
    rank, world = proc.rank, proc.world_size
    if overwrite and rank == 0:
        for folder in folders:
            for p in (folder / MARKERS).glob("*.json"):
                p.unlink()
    proc.barrier()
    encoder = None
    results = []
    for folder in folders:
        sizes = read_sizes(folder)
        names = sorted(sizes)
        todo = [n for k, n in enumerate(names) if k % world == rank and not _shard_done(folder, n, model)]
        if todo and encoder is None:
            encoder = _load_encoder(model, device or proc.device)
        n = embed_shards(folder, todo, sizes, model, encoder, batch_size)
        results.append({"folder": str(folder), "embedded": n, "shards": len(todo)})
    proc.barrier()
    if rank == 0:
        for folder, res in zip(folders, results):
            names = sorted(read_sizes(folder))
            markers = [json.loads(_marker(folder, n).read_text()) for n in names if _shard_done(folder, n, model)]
            if len(markers) != len(names):
                raise EmbedError(f"{folder}: {len(names) - len(markers)} shard(s) not embedded; run embed again")
            manifest = read_manifest(folder)
            manifest["embedding"] = {"model": model, "dim": markers[0]["dim"], "normalized": True,
                                     "dtype": "float16", "count": sum(m["count"] for m in markers)}
            write_json_atomic(folder / MANIFEST, manifest)
            res["dim"] = markers[0]["dim"]
    return results
