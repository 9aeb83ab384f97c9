"""Caption embeddings beside the shards: embed never touches a tar, training reads the sidecars, a
tampered sidecar is counted (missing_embedding), never a crash."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from mmpretrain.data.decode import SampleDecoder
from mmpretrain.data.plan import StreamPlan
from mmpretrain.data.sidecar import attach_embeddings
from mmpretrain.data.sources import resolve_sources
from mmpretrain.data.stream import TrainStream, make_loader

from conftest import ROOT, TEXT_MODEL, run_main, train


def _snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _unembedded(openmoji: Path, dst: Path) -> Path:
    """The training split's shards, sizes and manifest only (as a dataset someone else built)."""
    dst.mkdir()
    for p in (openmoji / "train").iterdir():
        if p.suffix == ".tar" or p.name == "sizes.json":
            shutil.copy(p, dst / p.name)
    manifest = json.loads((openmoji / "train/manifest.json").read_text())
    manifest.pop("embedding")
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def test_embed_beside_shards_it_may_not_write_and_train_from_there(openmoji, tmp_path):
    data = _unembedded(openmoji, tmp_path / "theirs")
    before = _snapshot(data)
    emb = tmp_path / "emb"
    r = run_main("data_tools", "embed", str(data), "--model", TEXT_MODEL, "--out", str(emb))
    assert r.returncode == 0, r.stderr[-2000:]
    assert _snapshot(data) == before  # not one byte of the dataset folder changed, nothing added
    index = json.loads((emb / "embeddings.json").read_text())
    sizes = json.loads((data / "sizes.json").read_text())
    assert index["model"] == TEXT_MODEL and index["dim"] == 384 and index["count"] == sum(sizes.values())
    assert {n: r_["count"] for n, r_ in index["shards"].items()} == sizes
    # a re-run embeds nothing; verify and stats read the sidecars
    r = run_main("data_tools", "embed", str(data), "--model", TEXT_MODEL, "--out", str(emb))
    assert r.returncode == 0 and all(j["embedded"] == 0 for j in json.loads(r.stdout)), r.stderr[-2000:]
    r = run_main("data_tools", "verify", str(data), "--embeddings", str(emb), "--strict")
    assert r.returncode == 0, r.stdout
    stats = json.loads(run_main("data_tools", "stats", str(data), "--embeddings", str(emb)).stdout)[0]
    assert stats["with_embedding"] == stats["samples"]
    # training reads them (data.embeddings), not one sample without its embedding
    run = tmp_path / "run"
    r = train(data, run, f"data.embeddings={emb}", "train.steps=3", "data.batch_size=32", "data.num_workers=1")
    assert r.returncode == 0, r.stderr[-3000:]
    final = json.loads((run / "log.jsonl").read_text().splitlines()[-1])
    assert final["step"] == 3 and "missing_embedding" not in final.get("skipped", {})
    # without data.embeddings the shards' own folder holds none: refused before training, with the fix
    r = train(data, tmp_path / "run2", "train.steps=2", "data.num_workers=0")
    assert r.returncode == 2 and "data_tools embed" in r.stderr, r.stderr[-2000:]


def _epoch(folder: Path) -> Counter:
    sources = resolve_sources(str(folder))
    attach_embeddings(sources, None)
    total = sources[0].num_samples
    plan = StreamPlan(sources, "epoch", 0, 1, 1, 10, total, 0)
    from open_clip.transform import PreprocessCfg, image_transform_v2

    decoder = SampleDecoder(image_transform_v2(PreprocessCfg(size=32), is_train=False), embeddings="require",
                            embedding_dim=384)
    it = iter(make_loader(TrainStream(plan, decoder, 0), 0))
    skipped: Counter = Counter()
    for _ in range(plan.steps_per_epoch):
        skipped.update(next(it).skipped)
    return skipped


def test_tampered_sidecars_are_counted_not_a_crash(openmoji, tmp_path, caplog):
    data = tmp_path / "train"
    shutil.copytree(openmoji / "train", data)
    sizes = json.loads((data / "sizes.json").read_text())
    names = sorted(sizes)
    f = {n: data / f"{n}.emb.npy" for n in names}
    k = {n: data / f"{n}.keys.txt" for n in names}
    raw = f[names[0]].read_bytes()
    f[names[0]].write_bytes(raw[: len(raw) // 2])                                   # truncated
    keys = k[names[1]].read_text().splitlines()
    keys[3], keys[4] = keys[4], keys[3]
    k[names[1]].write_text("\n".join(keys) + "\n")                                  # other key order: 2 samples
    np.save(f[names[2]], np.load(f[names[2]])[:-1])                                 # a row short
    k[names[3]].write_bytes(b"")                                                    # 0-byte keys
    np.save(f[names[4]], np.load(f[names[4]]).astype(np.float32)[:, :128])          # another dimension
    with open(data / names[5], "ab") as out:  # a rebuilt shard: another size than when it was embedded
        out.write(b"\0" * 10240)
    with caplog.at_level(logging.WARNING, logger="mmpretrain.data"):
        skipped = _epoch(data)
    whole = sum(sizes[n] for n in (names[0], names[2], names[3], names[4], names[5]))
    assert skipped["missing_embedding"] == whole + 2
    warned = [r.getMessage() for r in caplog.records if "embeddings" in r.getMessage()]
    for n in names[:6]:
        assert sum(n in w for w in warned) == 1, (n, warned)  # the reason, once per shard
    # verify names each one
    r = run_main("data_tools", "verify", str(data))
    assert r.returncode == 0 and "bad_embedding_file: 5" in r.stdout and "missing_embedding: 2" in r.stdout, r.stdout


def test_in_tar_embeddings_still_train(openmoji, tmp_path):
    from data_copies import in_tar_copy

    data = in_tar_copy(openmoji / "train", tmp_path / "train")
    assert not list(data.glob("*.emb.npy"))
    skipped = _epoch(data)
    assert "missing_embedding" not in skipped and "bad_embedding" not in skipped


@pytest.mark.parametrize("bad, words", [("{tmp}/nowhere", "no readable embeddings.json"),
                                        ("{tmp}/emb::{tmp}/emb", "2 folder(s) for 1 source(s)"),
                                        ("{test}", "records none of the shards")])
def test_data_embeddings_errors_name_the_setting(openmoji, tmp_path, bad, words):
    from mmpretrain.config import ConfigError, load_config
    from mmpretrain.train.inputs import load_sources

    bad = bad.replace("{test}", str(openmoji / "test"))  # the held-out split's embeddings
    cfg = load_config(ROOT / "configs/demo.yaml", [f"data.train={openmoji / 'train'}",
                                                   f"data.embeddings={bad.replace('{tmp}', str(tmp_path))}"])
    with pytest.raises(ConfigError, match="data.embeddings"):
        load_sources(cfg)
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        load_sources(cfg)


def test_embed_remote_shards_by_pattern_into_a_local_folder(openmoji, tmp_path):
    """Shards named by a brace pattern on an fsspec filesystem (memory://, as s3:// or hf:// would be)
    with their sizes.json: the embeddings go to --out, and the stream reads both."""
    import fsspec

    from data_tools.embed import EmbedError, embed

    fs = fsspec.filesystem("memory")
    sizes = json.loads((openmoji / "train/sizes.json").read_text())
    names = sorted(sizes)[:3]
    for n in names:
        fs.pipe(f"/bucket/{n}", (openmoji / "train" / n).read_bytes())
    fs.pipe("/bucket/sizes.json", json.dumps({n: sizes[n] for n in names}).encode())
    pattern = f"memory://bucket/openmoji-train-{{000000..{len(names) - 1:06d}}}.tar"
    with pytest.raises(EmbedError, match="--out"):
        embed(pattern, TEXT_MODEL)  # nowhere local to write beside the shards
    emb = tmp_path / "emb"
    res = embed(pattern, TEXT_MODEL, out=emb)
    assert res[0]["embedded"] == sum(sizes[n] for n in names)
    index = json.loads((emb / "embeddings.json").read_text())
    assert sorted(index["shards"]) == names and all(index["shards"][n]["bytes"] == (openmoji / "train" / n).stat().st_size
                                                    for n in names)
    sources = resolve_sources(pattern)
    attach_embeddings(sources, str(emb))
    plan = StreamPlan(sources, "epoch", 0, 1, 1, 10, sources[0].num_samples, 0)
    from open_clip.transform import PreprocessCfg, image_transform_v2

    decoder = SampleDecoder(image_transform_v2(PreprocessCfg(size=32), is_train=False), embeddings="require",
                            embedding_dim=384)
    it = iter(make_loader(TrainStream(plan, decoder, 0), 0))
    batches = [next(it) for _ in range(plan.steps_per_epoch)]
    assert all("missing_embedding" not in b.skipped for b in batches)
    assert sum(len(b.keys) for b in batches) == plan.steps_per_epoch * 10
    fs.rm("/bucket", recursive=True)


def test_embed_refuses_bad_paths_before_any_work(openmoji, tmp_path):
    from data_tools.embed import EmbedError, embed

    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "embeddings.json").write_text('{"mine": true}')  # a user's file of that name in --out
    for path, out, words in ((openmoji / "train", theirs, "is not an index embed wrote"),
                             (tmp_path / "nowhere", None, "no such dataset folder or shard"),
                             (tmp_path, None, "holds no dataset"),
                             (openmoji, notes, "is a file, not a folder"),
                             (openmoji / "train", notes / "emb", "is a file, not a folder")):
        with pytest.raises(EmbedError, match=words):
            embed(path, TEXT_MODEL, out=out)
    assert notes.read_text() == "mine" and (theirs / "embeddings.json").read_text() == '{"mine": true}'


def test_embed_beside_read_only_shards_asks_for_out(openmoji, monkeypatch):
    """Tests run as root, for whom nothing is read-only: the permission check is patched."""
    import os

    from data_tools.embed import EmbedError, embed

    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(EmbedError, match="not writable .*give --out EMB_DIR"):
        embed(openmoji / "train", TEXT_MODEL)
