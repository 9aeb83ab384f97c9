"""Copies of a built dataset in other shapes, for the tests that need them: the in-tar embedding layout
of datasets embedded before the sidecars, and the images as plain files (a folder, a server)."""

from __future__ import annotations

from pathlib import Path


def in_tar_copy(src: Path, dst: Path) -> Path:
    """A copy of a sidecar-embedded dataset folder in the earlier layout: each sample's embedding as an
    in-tar ``{key}.emb.npy`` member, no sidecar files (datasets embedded before the sidecars look so)."""
    import io
    import json
    import shutil

    import numpy as np
    import webdataset as wds

    from mmpretrain.data.tar import read_tar

    dst.mkdir(parents=True)
    index = json.loads((src / "embeddings.json").read_text())
    for name in index["shards"]:
        rows = np.load(src / f"{name}.emb.npy")
        with wds.TarWriter(str(dst / name), encoder=False) as w:
            for sample, row in zip(read_tar(src / name), rows):
                buf = io.BytesIO()
                np.save(buf, row)
                w.write({**sample, "emb.npy": buf.getvalue()})
    shutil.copy(src / "sizes.json", dst / "sizes.json")
    manifest = json.loads((src / "manifest.json").read_text())
    manifest["embedding"].pop("layout", None)
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def extract_images(dataset: Path, shards: int, dest: Path) -> list[tuple[str, str]]:
    """The PNG images and captions of a built dataset's first ``shards`` training shards, written as files
    into ``dest``: ``[(caption, file name)]`` (real images for the tests that need a folder or a server)."""
    import tarfile

    dest.mkdir(parents=True, exist_ok=True)
    rows = []
    for shard in sorted((dataset / "train").glob("*.tar"))[:shards]:
        with tarfile.open(shard) as t:
            members = {m.name: t.extractfile(m).read() for m in t.getmembers() if m.isfile()}
        for name, data in members.items():
            if name.endswith(".png"):
                (dest / name).write_bytes(data)
                rows.append((members[name[:-4] + ".txt"].decode(), name))
    return rows
