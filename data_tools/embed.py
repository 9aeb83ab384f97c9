"""``embed DIR --model NAME_OR_PATH``: store each caption's frozen embedding as ``{key}.emb.npy``.

float16, L2-normalised, shape ``(E,)``. Each shard is rewritten through a temporary file and an
atomic rename, so an interrupted run leaves every shard either old or new, never half-written; a
re-run skips shards whose samples already carry embeddings of the recorded model.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import webdataset as wds

from mmpretrain.data.manifest import MANIFEST, SIZES, read_manifest, read_sizes, write_json_atomic
from mmpretrain.data.shards import iter_samples


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


def embed_folder(folder: Path, model: str, *, overwrite: bool, batch_size: int, encoder=None,
                 device: str | None = None) -> dict:
    check_model(folder, model, overwrite)
    manifest = read_manifest(folder)
    recorded = (manifest.get("embedding") or {}).get("model")
    done = set(manifest.get("embedding", {}).get("shards", [])) if recorded == model and not overwrite else set()
    todo = [name for name in sorted(read_sizes(folder)) if name not in done]
    dim = (manifest.get("embedding") or {}).get("dim")
    n = 0
    for name in todo:
        if encoder is None:
            encoder = _load_encoder(model, device)
        samples = list(iter_samples(folder / name))
        captions = [s["txt"].decode("utf-8") for s in samples]
        embs = encoder.encode(captions, batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True)
        embs = embs.astype(np.float16)
        dim = int(embs.shape[1])
        tmp = folder / (name + ".tmp")
        with wds.TarWriter(str(tmp), encoder=False) as w:
            for s, e in zip(samples, embs):
                buf = io.BytesIO()
                np.save(buf, e)
                out = {k: v for k, v in s.items() if k not in ("__url__", "emb.npy")}
                out["emb.npy"] = buf.getvalue()
                w.write(out)
        os.replace(tmp, folder / name)
        n += len(samples)
        done.add(name)
        manifest["embedding"] = {"model": model, "dim": dim, "normalized": True, "dtype": "float16",
                                 "shards": sorted(done)}
        write_json_atomic(folder / MANIFEST, manifest)
    return {"folder": str(folder), "embedded": n, "shards": len(todo), "dim": dim}


def embed(path: str | Path, model: str, *, overwrite: bool = False, batch_size: int = 256,
          device: str | None = None) -> list[dict]:
    folders = dataset_folders(path)
    for folder in folders:  # refuse before loading anything
        check_model(folder, model, overwrite)
    encoder = None
    results = []
    for folder in folders:
        if encoder is None:
            encoder = _load_encoder(model, device)
        results.append(embed_folder(folder, model, overwrite=overwrite, batch_size=batch_size, encoder=encoder))
    return results
