"""Copies of a built dataset in other shapes, for the tests that need them: the in-tar embedding layout
of datasets embedded before the sidecars, the images as plain files (a folder, a server), and a captions
TSV with broken rows among good ones (the build's input)."""

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


def broken_tsv(root: Path, emoji_images, good_rows: int = 950) -> Path:
    """``good_rows`` good rows (950: 1,000 rows in all) and 50 broken in 7 ways, interleaved: a
    ``captions.tsv`` in ``root`` of ``emoji_images`` copied to ``root/imgs``."""
    import io

    from PIL import Image

    imgs = root / "imgs"
    imgs.mkdir()
    good = []
    for path, caption in emoji_images:
        (imgs / path.name).write_bytes(path.read_bytes())
        good.append((path.name, caption))
    (imgs / "zero.jpg").write_bytes(b"")
    (imgs / "text.jpg").write_bytes(b"this is not an image at all")
    buf = io.BytesIO()
    Image.open(imgs / good[1][0]).convert("RGB").resize((256, 256)).save(buf, format="JPEG")
    (imgs / "cut.jpg").write_bytes(buf.getvalue()[: len(buf.getvalue()) * 7 // 10])  # the tail is missing
    Image.new("1", (9000, 9000)).save(imgs / "bomb.png")  # 81 Mpx, a few KB on disk
    rows = [(good[i % len(good)][0], good[i % len(good)][1].encode()) for i in range(good_rows)]
    rows += [("nope.jpg", b"a missing file")] * 10 + [("zero.jpg", b"zero bytes")] * 10
    rows += [("text.jpg", b"not an image")] * 10 + [("cut.jpg", b"truncated")] * 10
    rows += [(good[0][0], b"  ")] * 4 + [(good[0][0], b"caf\xe9 latin-1")] * 3 + [("bomb.png", b"a bomb")] * 3
    n = len(rows)
    order = sorted(range(n), key=lambda i: (i * 7919) % n)  # interleave the bad rows (7919: prime, > n)
    tsv = root / "captions.tsv"
    tsv.write_bytes(b"image\tcaption\n" + b"".join(f"imgs/{rows[i][0]}\t".encode() + rows[i][1] + b"\n"
                                                   for i in order))
    return tsv
