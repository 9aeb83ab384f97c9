"""No command loses what a user has: the export never replaces the run or a user's files, the build never
deletes its own input or files it did not write. Each case through the command line, as a user would."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import run_main


@pytest.fixture(scope="module")
def trained(demo_run, tmp_path_factory):
    """A tiny trained run (a copy of the session's demo run) inside a folder that also holds a sibling run."""
    runs = tmp_path_factory.mktemp("runs")
    run = runs / "mine"
    shutil.copytree(demo_run, run)
    (runs / "sibling").mkdir()
    (runs / "sibling" / "notes.txt").write_text("a sibling run's notes")
    return run


def _snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _export(run, out, *extra):
    return run_main("mmpretrain.export", str(run), "--out", str(out), *extra)


def test_export_refuses_the_run_folder_and_above(trained):
    before = _snapshot(trained.parent)
    for out in (trained, trained.parent):
        for extra in ([], ["--overwrite"]):
            r = _export(trained, out, *extra)
            assert r.returncode == 2 and "run folder" in r.stderr, r.stderr[-2000:]
    assert _snapshot(trained.parent) == before  # checkpoints and the sibling run untouched


def test_export_keeps_a_users_files_and_replaces_only_its_own(trained, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.md").write_text("my notes")
    r = _export(trained, out)
    assert r.returncode == 2 and "not empty" in r.stderr and "--overwrite" in r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["notes.md"]
    r = _export(trained, out, "--overwrite")
    assert r.returncode == 0, r.stderr[-2000:]
    assert (out / "notes.md").read_text() == "my notes" and (out / "open_clip_model.safetensors").is_file()
    listed = json.loads((out / "export_manifest.json").read_text())["files"]
    assert "notes.md" not in listed and "open_clip_model.safetensors" in listed
    # a re-export replaces its own files, removes what it no longer writes, keeps the notes
    stale = listed[0]
    (out / "extra_from_an_old_export.bin").write_text("x")
    manifest = json.loads((out / "export_manifest.json").read_text())
    manifest["files"].append("extra_from_an_old_export.bin")
    (out / "export_manifest.json").write_text(json.dumps(manifest))
    assert _export(trained, out).returncode == 2  # still needs --overwrite
    r = _export(trained, out, "--overwrite")
    assert r.returncode == 0, r.stderr[-2000:]
    assert not (out / "extra_from_an_old_export.bin").exists() and (out / stale).exists()
    assert (out / "notes.md").read_text() == "my notes"
    # a user's file where the export would write one of its own: refused, the file kept
    (out / "export_manifest.json").unlink()
    (out / "README.md").write_text("my own readme")
    r = _export(trained, out, "--overwrite")
    assert r.returncode == 2 and "README.md" in r.stderr
    assert (out / "README.md").read_text() == "my own readme"
    assert not list(tmp_path.glob(".*.tmp")) and not list(tmp_path.glob("*.tmp"))


def test_export_to_a_file_is_refused_and_leaves_nothing_behind(trained, tmp_path):
    target = tmp_path / "model.bin"
    target.write_text("a user's file")
    r = _export(trained, target)
    assert r.returncode == 2 and "is a file" in r.stderr
    assert target.read_text() == "a user's file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.bin"]


def test_export_inside_the_run_folder_is_fine(trained):
    r = _export(trained, trained / "export")
    assert r.returncode == 0, r.stderr[-2000:]
    assert (trained / "export/open_clip_model.safetensors").is_file()
    assert (trained / "checkpoints").is_dir()
    shutil.rmtree(trained / "export")


def _build(*args):
    return run_main("data_tools", "build", *map(str, args))


def test_build_never_reads_and_writes_the_same_place(openmoji, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(openmoji / "train", src)  # a shard folder is also a valid (img2dataset-style) source
    before = _snapshot(src)
    for out in (src, src / "inside", tmp_path):
        r = _build(src, "--out", out, "--overwrite")
        assert r.returncode == 2 and "the source" in r.stderr, r.stderr[-2000:]
    assert _snapshot(src) == before and not (src / "inside").exists()


def test_build_overwrite_removes_only_what_a_build_wrote(openmoji, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(openmoji / "train", src)
    out = tmp_path / "out"
    assert _build(src, "--out", out, "--image-size", "32").returncode == 0
    (out / "notes.txt").write_text("mine")
    r = _build(src, "--out", out, "--image-size", "16", "--overwrite")  # other options: a rebuild
    assert r.returncode == 0, r.stderr[-2000:]
    assert (out / "notes.txt").read_text() == "mine"
    # a tar file no build wrote: refused with or without --overwrite, and kept
    (out / "my_own.tar").write_bytes(b"not ours")
    for extra in ([], ["--overwrite"]):
        r = _build(src, "--out", out, "--image-size", "16", *extra)
        assert r.returncode == 2 and "my_own.tar" in r.stderr, r.stderr[-2000:]
    assert (out / "my_own.tar").read_bytes() == b"not ours"


@pytest.mark.integration  # starts processes (or builds real data): not in make test-unit
def test_demo_overwrite_keeps_a_users_files(tmp_path):
    out = tmp_path / "demo"
    args = ["demo:openmoji", "--out", out, "--image-size", "16", "--limit", "500", "--shard-size", "100"]
    assert _build(*args).returncode == 0
    (out / "train" / "notes.txt").write_text("mine")
    (out / "README.txt").write_text("mine too")
    r = _build(*args, "--overwrite")
    assert r.returncode == 0, r.stderr[-2000:]
    assert (out / "train" / "notes.txt").read_text() == "mine" and (out / "README.txt").read_text() == "mine too"
    assert json.loads((out / "train/sizes.json").read_text())


@pytest.mark.integration  # starts processes (or builds real data): not in make test-unit
def test_embed_after_a_rebuild_embeds_the_new_shards(tmp_path):
    """build --overwrite replaces the shards but leaves embed's own records: those must be seen as stale
    (make demo runs build --overwrite, then embed, then training that needs the embeddings)."""
    from conftest import TEXT_MODEL

    out = tmp_path / "demo"
    args = ["demo:openmoji", "--out", out, "--image-size", "16", "--limit", "500", "--shard-size", "100"]
    assert _build(*args).returncode == 0
    assert run_main("data_tools", "embed", str(out), "--model", TEXT_MODEL).returncode == 0
    assert _build(*args, "--overwrite").returncode == 0
    r = run_main("data_tools", "embed", str(out), "--model", TEXT_MODEL)
    assert r.returncode == 0, r.stderr[-2000:]
    assert all(e["embedded"] > 0 for e in json.loads(r.stdout))  # every split re-embedded
    r = run_main("data_tools", "verify", str(out))
    assert r.returncode == 0 and "missing_embedding" not in r.stdout, r.stdout[-2000:]


def test_embed_overwrite_with_a_model_it_cannot_load_keeps_the_earlier_records(openmoji, tmp_path):
    """--overwrite drops embed's records of the earlier model; a misspelt --model used to drop them and
    then fail to load (an OSError traceback): now it is refused before anything is touched."""
    data = tmp_path / "data"
    shutil.copytree(openmoji, data)
    before = _snapshot(data)
    for model in ("nobody/no-such-encoder", str(tmp_path / "no-such-folder")):
        r = run_main("data_tools", "embed", str(data), "--model", model, "--overwrite")
        assert r.returncode == 2 and "--model" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert _snapshot(data) == before
