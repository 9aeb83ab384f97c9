"""data_tools on real packaged data (OpenMoji), through the public commands."""

import json

import numpy as np

from mmpretrain.data.tar import read_tar

from conftest import TEXT_MODEL, run_main


def test_build_layout(openmoji):
    for split in ("train", "test"):
        sizes = json.loads((openmoji / split / "sizes.json").read_text())
        manifest = json.loads((openmoji / split / "manifest.json").read_text())
        assert sum(sizes.values()) == manifest["counts"]["samples"] > 0
        assert manifest["skipped"] == {}
        assert manifest["embedding"] == {"model": TEXT_MODEL, "dim": 384, "normalized": True, "dtype": "float16",
                                         "count": sum(sizes.values()), "layout": "sidecar"}
        index = json.loads((openmoji / split / "embeddings.json").read_text())
        assert {k: index[k] for k in manifest["embedding"] if k != "layout"} == {
            k: v for k, v in manifest["embedding"].items() if k != "layout"}
        for name, n in sizes.items():
            samples = list(read_tar(openmoji / split / name))
            assert len(samples) == n
            assert {"png", "txt", "json"} <= set(samples[0]) and "emb.npy" not in samples[0]  # tars untouched
            rows = np.load(openmoji / split / f"{name}.emb.npy")
            keys = (openmoji / split / f"{name}.keys.txt").read_text().splitlines()
            assert rows.dtype == np.float16 and rows.shape == (n, 384) and keys == [s["__key__"] for s in samples]
            assert np.allclose(np.linalg.norm(rows.astype(np.float32), axis=1), 1, atol=1e-2)
            assert index["shards"][name] == {"count": n, "bytes": (openmoji / split / name).stat().st_size,
                                             "first_key": keys[0], "extra": 0}
    # clip_benchmark's wds layout for the labelled held-out split
    classes = (openmoji / "classnames.txt").read_text().split("\n")[:-1]
    assert len(classes) >= 2
    assert "{c}" in (openmoji / "zeroshot_classification_templates.txt").read_text()
    assert (openmoji / "test" / "nshards.txt").read_text().strip() == "1"
    labelled = list(read_tar(openmoji / "test" / "0.tar"))
    assert labelled and all(0 <= int(s["cls"]) < len(classes) for s in labelled)


def test_split_is_deterministic_and_disjoint(openmoji, tmp_path):
    r = run_main("data_tools", "build", "demo:openmoji", "--out", str(tmp_path / "again"), "--image-size", "32",
                "--shard-size", "50", "--limit", "500")
    assert r.returncode == 0, r.stderr
    keys = {}
    for root in (openmoji, tmp_path / "again"):
        for split in ("train", "test"):
            keys[(root, split)] = [s["__key__"] for p in sorted((root / split).glob("openmoji-*.tar"))
                                   for s in read_tar(p)]
    assert keys[(openmoji, "train")] == keys[(tmp_path / "again", "train")]
    assert keys[(openmoji, "test")] == keys[(tmp_path / "again", "test")]
    assert not set(keys[(openmoji, "train")]) & set(keys[(openmoji, "test")])


def test_verify_stats_and_refusals(openmoji, tmp_path):
    r = run_main("data_tools", "verify", str(openmoji))
    assert r.returncode == 0, r.stdout + r.stderr
    stats = json.loads(run_main("data_tools", "stats", str(openmoji / "test")).stdout)
    assert stats[0]["with_embedding"] == stats[0]["samples"]
    # rebuilding over an existing dataset needs --overwrite; nothing is touched without it
    r = run_main("data_tools", "build", "demo:openmoji", "--out", str(openmoji), "--limit", "50")
    assert r.returncode == 2 and "--overwrite" in r.stderr
    # another embedding model than the recorded one
    r = run_main("data_tools", "embed", str(openmoji), "--model", "some/other-model")
    assert r.returncode == 2 and "--overwrite" in r.stderr


def test_verify_catches_corruption(openmoji, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(openmoji / "test", bad)
    shard = sorted(bad.glob("openmoji-test-*.tar"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    r = run_main("data_tools", "verify", str(bad))
    assert r.returncode == 1
    assert shard.name in r.stdout
    # stats reads what it can and names the shard it could not read (no traceback)
    r = run_main("data_tools", "stats", str(bad))
    assert r.returncode == 0, r.stderr[-2000:]
    stats = json.loads(r.stdout)[0]
    assert [u.split(":")[0] for u in stats["unreadable_shards"]] == [shard.name] and stats["samples"] > 0
