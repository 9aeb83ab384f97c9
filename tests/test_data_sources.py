"""data_tools build from every source kind, on generated files holding real OpenMoji renders, with
every kind of bad input counted by reason."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from data_copies import broken_tsv
from PIL import Image

from data_tools.build import BuildError, build
from mmpretrain.data.tar import read_tar

from conftest import run_main

KW = dict(image_size=32, shard_size=100, workers=1)


def shard_content(folder: Path) -> list[tuple]:
    sizes = json.loads((folder / "sizes.json").read_text())
    # shard names are prefixed with the folder's name; compare their numbers
    return [(name.rsplit("-", 1)[1], s["__key__"], s["txt"], s.get("jpg")) for name in sorted(sizes)
            for s in read_tar(folder / name)]


def test_tsv_with_broken_rows(tmp_path, emoji_images):
    tsv = broken_tsv(tmp_path, emoji_images)
    out = tmp_path / "cc"
    r = run_main("data_tools", "build", str(tsv), "--out", str(out), "--image-size", "32", "--shard-size", "200",
                "--workers", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["samples"] == 950
    assert manifest["skipped"] == {"missing_file": 10, "zero_byte_file": 10, "not_an_image": 10,
                                   "truncated_image": 10, "empty_caption": 4, "caption_not_utf8": 3,
                                   "too_many_pixels": 3}
    assert sum(json.loads((out / "sizes.json").read_text()).values()) == 950
    v = run_main("data_tools", "verify", str(out), "--strict")
    assert v.returncode == 0, v.stdout
    # same shards whatever the number of processes
    single = tmp_path / "cc1"
    build(str(tsv), single, image_size=32, shard_size=200, workers=1)
    assert [c[1:] for c in shard_content(out)] == [c[1:] for c in shard_content(single)]


def test_csv_parquet_and_columns(tmp_path, emoji_images):
    import pandas as pd

    df = pd.DataFrame({"path": [str(p) for p, _ in emoji_images], "text": [c for _, c in emoji_images],
                       "id": [f"img.{i}" for i in range(len(emoji_images))]})
    df.to_csv(tmp_path / "t.csv", index=False)
    df.to_parquet(tmp_path / "t.parquet")
    for name in ("t.csv", "t.parquet"):
        res = build(str(tmp_path / name), tmp_path / name.replace(".", "_"), image_column="path",
                    caption_column="text", key_column="id", **KW)
        assert res["samples"] == 20 and res["skipped"] == {}
    keys = [k for _, k, _, _ in shard_content(tmp_path / "t_csv")]
    assert keys[:2] == ["img_0", "img_1"]  # dots would split WebDataset keys
    r = run_main("data_tools", "build", str(tmp_path / "t.csv"), "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and "'image'" in r.stderr and "--image-column" in r.stderr
    (tmp_path / "t.xlsx").write_text("x")
    r = run_main("data_tools", "build", str(tmp_path / "t.xlsx"), "--out", str(tmp_path / "y"))
    assert r.returncode == 2 and "t.xlsx" in r.stderr


def test_image_folder_captions_and_duplicates(tmp_path, emoji_images):
    folder = tmp_path / "folder"
    (folder / "sub").mkdir(parents=True)
    for i, (path, caption) in enumerate(emoji_images[:6]):
        dest = folder / ("sub" if i % 2 else ".") / path.name
        dest.write_bytes(path.read_bytes())
        if i != 5:
            dest.with_suffix(".txt").write_text(caption)
    dup = folder / emoji_images[0][0].name
    Image.open(dup).save(dup.with_suffix(".png" if dup.suffix == ".jpg" else ".jpg"))  # same stem, other format
    res = build(str(folder), tmp_path / "out", **KW)
    assert res["samples"] == 5 and res["skipped"] == {"missing_caption": 1, "duplicate_key": 1}
    captions = tmp_path / "captions.tsv"
    captions.write_text("file\tcaption\n" + "".join(f"{p.relative_to(folder).as_posix()}\tan emoji\n"
                                                    for p in sorted(folder.rglob("*.*")) if p.suffix != ".txt"))
    res = build(str(folder), tmp_path / "out2", captions=str(captions), **KW)
    assert res["samples"] == 6 and res["skipped"] == {"duplicate_key": 1}


def test_img2dataset_output(tmp_path, emoji_images):
    import webdataset as wds

    src = tmp_path / "i2d"
    src.mkdir()
    for t in range(2):
        with wds.TarWriter(str(src / f"{t:05d}.tar"), encoder=False) as w:
            for i, (path, caption) in enumerate(emoji_images[t * 10:(t + 1) * 10]):
                img = Image.open(path).convert("RGB")
                buf = io.BytesIO()
                img.save(buf, format="JPEG")
                w.write({"__key__": f"{t:05d}{i:04d}", "jpg": buf.getvalue() if i != 3 else b"garbage",
                         "txt": caption.encode(), "json": json.dumps({"url": f"http://x/{i}.jpg"}).encode()})
    (src / "00000.parquet").write_bytes(b"")  # img2dataset writes these beside the tars
    res = build(str(src), tmp_path / "out", **KW)
    assert res["samples"] == 18 and res["skipped"] == {"not_an_image": 2} and res["shards"] == 2
    meta = json.loads(next(read_tar(sorted((tmp_path / "out").glob("*.tar"))[0]))["json"])
    assert meta["url"].startswith("http://x/")
    # --shard-size cuts each input tar (img2dataset writes 10,000 per tar): 10 -> 4 + 4 + 2, twice
    small = build(str(src), tmp_path / "small", **{**KW, "shard_size": 4})
    sizes = json.loads((tmp_path / "small/sizes.json").read_text())
    assert small["shards"] == 6 and small["samples"] == 18 and small["skipped"] == {"not_an_image": 2}
    assert sorted(sizes.values()) == [2, 2, 3, 3, 4, 4]  # the two garbage images fall in the first pieces

    def keys(folder):
        return [s["__key__"] for t in sorted(folder.glob("*.tar")) for s in read_tar(t)]

    assert keys(tmp_path / "small") == keys(tmp_path / "out")  # the same samples, in the same order


def test_hf_saved_dataset(tmp_path, emoji_images):
    import datasets

    ds = datasets.Dataset.from_dict({"image": [str(p) for p, _ in emoji_images],
                                     "text": [c for _, c in emoji_images]}).cast_column("image", datasets.Image())
    ds.save_to_disk(str(tmp_path / "hfds"))
    res = build(str(tmp_path / "hfds"), tmp_path / "out", **KW)
    assert res["samples"] == 20
    with pytest.raises(BuildError, match="caption"):
        build(str(tmp_path / "hfds"), tmp_path / "out2", caption_column="caption", **KW)


def test_interrupted_build_resumes_to_the_same_shards(tmp_path, emoji_images, monkeypatch):
    import data_tools.parallel as parallel

    tsv = broken_tsv(tmp_path, emoji_images)
    clean = tmp_path / "clean"
    build(str(tsv), clean, image_size=32, shard_size=150, workers=1)

    out = tmp_path / "resumed"
    real = parallel.write_chunk
    calls = []

    def dying(task):
        if len(calls) == 3:
            raise KeyboardInterrupt("killed")
        calls.append(task[3])
        return real(task)

    monkeypatch.setattr(parallel, "write_chunk", dying)
    with pytest.raises(KeyboardInterrupt):
        build(str(tsv), out, image_size=32, shard_size=150, workers=1)
    assert not (out / "sizes.json").exists()
    done = {name: (out / name).stat().st_mtime_ns for name in calls}
    monkeypatch.setattr(parallel, "write_chunk", real)
    res = build(str(tsv), out, image_size=32, shard_size=150, workers=1)
    assert res["written_now"] == res["chunks"] - 3
    assert {name: (out / name).stat().st_mtime_ns for name in calls} == done  # complete shards untouched
    assert shard_content(out) == shard_content(clean)
    assert json.loads((out / "manifest.json").read_text())["skipped"] == \
        json.loads((clean / "manifest.json").read_text())["skipped"]
    # another source into the same folder is refused
    with pytest.raises(BuildError, match="--overwrite"):
        build(str(tsv), out, image_size=64, shard_size=150, workers=1)


def test_build_and_embed_on_two_ranks(tmp_path, ddp_checks, demo_run):
    """Under accelerate launch each rank takes a disjoint part; the result equals one process's (caption
    rows, and a teacher's crops and rows: ``--image-model``, the demo's trained model). The session's
    2-rank launch (``ddp_checks``) ran ``python -m data_tools build`` then ``embed`` of a TSV of 250 good
    rows and 50 broken."""
    from conftest import TEXT_MODEL

    tsv, out, report = ddp_checks["build_tsv"], ddp_checks["build_out"], ddp_checks["runs"]
    assert [report[n]["exit"] for n in ("build", "embed")] == [0, 0], report
    single = tmp_path / "single"
    build(str(tsv), single, image_size=32, shard_size=50, workers=1)
    assert [c[1:] for c in shard_content(out)] == [c[1:] for c in shard_content(single)]  # embed left the tars
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["embedding"]["count"] == manifest["counts"]["samples"] == 250
    assert run_main("data_tools", "verify", str(out), "--strict").returncode == 0
    # the sidecars 2 ranks wrote equal one process's (rows to fp16 rounding: other batches, other padding)
    import numpy as np

    from data_tools.embed import embed

    embed(single, TEXT_MODEL)
    ranks, one = (json.loads((d / "embeddings.json").read_text()) for d in (out, single))
    assert ranks.pop("shards").keys() != one.pop("shards").keys() and ranks == one  # names carry the folder's
    pairs = list(zip(sorted(out.glob("*.tar")), sorted(single.glob("*.tar"))))
    assert len(pairs) == 6  # 300 rows (250 good) in shards of 50 rows
    for a, b in pairs:
        assert Path(f"{a}.keys.txt").read_text() == Path(f"{b}.keys.txt").read_text()
        np.testing.assert_allclose(np.load(f"{a}.emb.npy").astype(np.float32),
                                   np.load(f"{b}.emb.npy").astype(np.float32), atol=2e-3)
    from data_tools.embed_teacher import embed_teachers
    from mmpretrain.data.teacher import CROPS, teacher_files

    embed_teachers(single, [str(demo_run)], augmentations=2)
    ranks, one = (json.loads((d / "teachers.json").read_text()) for d in (out, single))
    (tid, block), = ranks["teachers"].items()
    assert ranks["augmentations"] == one["augmentations"] and len(block["shards"]) == 6
    assert sum(r["count"] for r in block["shards"].values()) == 250
    for a, b in pairs:
        assert np.array_equal(np.load(f"{a}{CROPS}"), np.load(f"{b}{CROPS}"))
        np.testing.assert_allclose(np.load(f"{a}{teacher_files(tid)[0]}").astype(np.float32),
                                   np.load(f"{b}{teacher_files(tid)[0]}").astype(np.float32), atol=2e-3)


def test_a_caption_list_column_becomes_the_samples_extra_captions(tmp_path, emoji_images):
    """--extra-captions-column: a list column (parquet, HF) or a JSON array (CSV) lands as 'captions' in
    each sample's json (caption 0 stays in txt); --negative-captions-column the same as
    'negative_captions', kept apart; a cell that is not a list of strings is a counted skip."""
    import datasets
    import pandas as pd

    extra = [[f"{c} drawn", f"an icon: {c}"] if i % 3 else [] for i, (_, c) in enumerate(emoji_images)]
    negs = [[f"not {c}"] if i % 2 else [] for i, (_, c) in enumerate(emoji_images)]
    paths, caps = [str(p) for p, _ in emoji_images], [c for _, c in emoji_images]
    pd.DataFrame({"image": paths, "caption": caps, "more": extra, "neg": negs}).to_parquet(tmp_path / "t.parquet")
    cells, neg_cells = [json.dumps(e) for e in extra], [json.dumps(n) for n in negs]
    cells[1] = "not json"
    neg_cells[3] = "[1, 2]"
    pd.DataFrame({"image": paths, "caption": caps, "more": cells, "neg": neg_cells}).to_csv(tmp_path / "t.csv",
                                                                                           index=False)
    ds = datasets.Dataset.from_dict({"image": paths, "text": caps, "more": extra, "neg": negs}).cast_column(
        "image", datasets.Image())
    ds.save_to_disk(str(tmp_path / "hfds"))
    for name, skipped in (("t.parquet", {}), ("t.csv", {"bad_extra_captions": 1, "bad_negative_captions": 1}),
                          ("hfds", {})):
        out = tmp_path / f"out_{name}"
        res = build(str(tmp_path / name), out, extra_captions_column="more", negative_captions_column="neg", **KW)
        assert res["skipped"] == skipped, name
        sizes = json.loads((out / "sizes.json").read_text())
        got = {int(json.loads(s["json"])["source_row"]): (s["txt"].decode(), json.loads(s["json"]).get("captions"),
                                                          json.loads(s["json"]).get("negative_captions"))
               for n in sizes for s in read_tar(out / n)}
        for i, (cap, more, neg) in got.items():
            assert cap == caps[i] and more == (extra[i] or None) and neg == (negs[i] or None), (name, i)
        assert len(got) == 20 - sum(skipped.values())
    with pytest.raises(BuildError, match="more2"):
        build(str(tmp_path / "t.csv"), tmp_path / "x", extra_captions_column="more2", **KW)
    with pytest.raises(BuildError, match="tables and HF"):
        build(str(emoji_images[0][0].parent), tmp_path / "y", extra_captions_column="more", **KW)
