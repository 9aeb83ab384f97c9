"""The newer surfaces (keep-lists, teacher rows, several captions, loading a teacher, filter's output folder)
tried through the command lines as a hostile user would, each case once a traceback, a misleading line, a
silent outcome or a user's file replaced: now a counted skip, or exit 2 with one line naming the file, key
or flag and the fix, and nothing of the user's touched."""

from __future__ import annotations

import io
import json
import pickle
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest

from mmpretrain.data.keep import KEEP
from mmpretrain.data.teacher import CROPS, TEACHERS, teacher_files

from conftest import run_main, train

DISTILL = ["model.arch=mmpt-tiny-vit", "model.lock_text=false", "model.text_from_targets=false", "train.steps=2",
           "data.batch_size=16", "data.num_workers=0", "loss=[{name: clip, weight: 0.5}, {name: distill, weight: 1.0}]"]
QUICK = ["model.arch=mmpt-tiny-vit", "model.lock_text=false", "model.text_from_targets=false", "data.batch_size=16",
         "data.num_workers=0", "loss=[{name: clip}]"]


def _one_line(r, *words):
    """Exit 2, one ``error:`` line holding every word, no traceback."""
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert all(w in errors[0] for w in words), (words, errors[0])
    return errors[0]


def _copy(teacher_data, tmp_path) -> tuple[Path, str, list[str]]:
    data = tmp_path / "data"
    shutil.copytree(teacher_data["data"], data)
    index = json.loads((data / TEACHERS).read_text())
    (tid,) = index["teachers"]
    return data, tid, sorted(index["teachers"][tid]["shards"])


def _last(run: Path) -> dict:
    return json.loads((run / "log.jsonl").read_text().splitlines()[-1])


# --------------------------------------------------------------------------- keep-lists

@pytest.mark.parametrize("edit, words", [
    (lambda j: j.update(version="1"), ["keep.json", "version is '1'", "data_tools filter"]),  # was a TypeError
    # was "the list was made from 50 samples ..., its sizes.json now says 50: the shard was rebuilt"
    (lambda j: j["shards"][sorted(j["shards"])[0]].update(total="50"), ["keep.json", ".total is '50'", "edited"]),
    (lambda j: j["shards"][sorted(j["shards"])[0]].update(kept=None), ["keep.json", ".kept is None"]),
])
def test_a_hand_edited_keep_list_is_one_line_naming_the_key(teacher_data, tmp_path, edit, words):
    data = teacher_data["data"]
    out = tmp_path / "keep"
    assert run_main("data_tools", "filter", str(data), "--out", str(out), "--score", "teacher", "--keep-top",
                    "0.9").returncode == 0
    index = json.loads((out / KEEP).read_text())
    edit(index)
    (out / KEEP).write_text(json.dumps(index))
    line = _one_line(train(data, tmp_path / "run", *QUICK, "train.steps=1", f"data.keep={out}"), *words)
    assert "rebuilt" not in line


def test_filter_never_replaces_or_deletes_a_file_it_did_not_write(teacher_data, tmp_path):
    data = teacher_data["data"]
    name = sorted(p.name for p in data.glob("*.tar"))[0]
    out = tmp_path / "keep"  # a folder without keep.json, holding a user's file of a keep-list's name
    out.mkdir()
    (out / f"{name}.keep.txt").write_text("my own notes\n")
    r = run_main("data_tools", "filter", str(data), "--out", str(out), "--score", "teacher", "--keep-top", "0.9")
    _one_line(r, f"{name}.keep.txt", "no earlier filter wrote", "another --out")  # was replaced, exit 0
    assert sorted(p.name for p in out.iterdir()) == [f"{name}.keep.txt"]
    assert (out / f"{name}.keep.txt").read_text() == "my own notes\n"

    made = tmp_path / "made"  # a list, then a hand edit naming a user's file as one of its own
    assert run_main("data_tools", "filter", str(data), "--out", str(made), "--score", "teacher", "--keep-top",
                    "0.9").returncode == 0
    index = json.loads((made / KEEP).read_text())
    index["shards"]["X.tar"] = {"total": 1, "kept": 1, "bytes": None, "first_key": "x"}
    index["files"].append("X.tar.keep.txt")
    index["digests"]["X.tar.keep.txt"] = "0" * 40
    (made / KEEP).write_text(json.dumps(index))
    (made / "X.tar.keep.txt").write_text("mine\n")
    (made / f"{name}.keep.txt").write_text("edited by hand\n")  # one of its files, changed since: not its to replace
    r = run_main("data_tools", "filter", str(data), "--out", str(made), "--score", "teacher", "--keep-top", "0.8",
                 "--overwrite")
    _one_line(r, f"{name}.keep.txt", "changed since")
    assert (made / f"{name}.keep.txt").read_text() == "edited by hand\n"
    (made / f"{name}.keep.txt").unlink()
    r = run_main("data_tools", "filter", str(data), "--out", str(made), "--score", "teacher", "--keep-top", "0.8",
                 "--overwrite")
    assert r.returncode == 0, r.stderr[-2000:]
    assert (made / "X.tar.keep.txt").read_text() == "mine\n"  # was deleted


@pytest.mark.parametrize("args, words", [
    (["--score", "teacher", "--keep-top", "1e-9"], ["keep no sample", "score: "]),  # wrote an empty list, exit 0
    (["--score", "teacher", "--min-score", "2"], ["--min-score 2.0", "[-1, 1]"]),
    (["--score", "teacher", "--min-score", "nan"], ["--min-score nan", "[-1, 1]"]),
])
def test_a_list_that_would_keep_nothing_is_refused(teacher_data, tmp_path, args, words):
    r = run_main("data_tools", "filter", str(teacher_data["data"]), "--out", str(tmp_path / "keep"), *args)
    _one_line(r, *words)
    assert not (tmp_path / "keep").exists()


def test_nan_and_inf_teacher_rows_are_dropped_and_counted_and_the_list_is_strict_json(teacher_data, tmp_path):
    data, tid, names = _copy(teacher_data, tmp_path)
    image = np.load(data / (names[0] + teacher_files(tid)[0]))
    image[:5] = np.nan
    image[5:8] = np.inf
    np.save(data / (names[0] + teacher_files(tid)[0]), image)
    r = run_main("data_tools", "filter", str(data), "--out", str(tmp_path / "dedup"), "--dedup", "image")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]  # was faiss's RuntimeError
    for out, args in (("dedup", []), ("score", ["--score", "teacher", "--keep-top", "1.0"])):
        if args:
            assert run_main("data_tools", "filter", str(data), "--out", str(tmp_path / out), *args).returncode == 0
        text = (tmp_path / out / KEEP).read_text()
        index = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in keep.json"))
        assert index["removed"]["nonfinite_rows"] == 8, index["removed"]
        kept = (tmp_path / out / f"{names[0]}.keep.txt").read_text().splitlines()
        first = (data / f"{names[0]}.teacher_keys.txt").read_text().splitlines()[:8]
        assert not set(first) & set(kept)  # keep-top 1.0 kept the NaN-scored ones, with threshold NaN


@pytest.mark.parametrize("flag, content, words", [
    ("--uids", "pickle", ["--uids", "pickled Python objects", "UID list"]),  # numpy: "Object arrays cannot be loaded"
    ("--uids", "text", ["--uids", "not a .npy array file"]),  # numpy: "...load it unsafely"
    ("--entries", "latin-1", ["--entries", "not UTF-8"]),  # a bare utf-8 codec error
])
def test_bad_uid_and_entry_files_are_named_by_their_flag(teacher_data, tmp_path, flag, content, words):
    path = tmp_path / "file"
    if content == "pickle":
        np.save(path.with_suffix(".npy"), np.array([{"uid": 1}], dtype=object), allow_pickle=True)
        path = path.with_suffix(".npy")
    else:
        path.write_bytes(b"caf\xe9 au lait\n" if content == "latin-1" else b"0123abcd\n")
    extra = ["--balance", "entries", "--cap", "3"] if flag == "--entries" else []
    r = run_main("data_tools", "filter", str(teacher_data["data"]), "--out", str(tmp_path / "keep"), flag, str(path),
                 *extra)
    assert "unsafely" not in _one_line(r, str(path), *words)


# --------------------------------------------------------------------------- teacher rows

@pytest.mark.parametrize("edit, words", [
    (lambda j, t: j["augmentations"].update(count="3"), ["teachers.json", "augmentations.count is '3'"]),  # TypeError
    (lambda j, t: j["teachers"][t].pop("dim"), ["teachers.json", ".dim is None"]),  # KeyError
    (None, ["teachers.json", "not valid JSON"]),  # cut short: was "holds no teachers.json"
])
def test_a_damaged_teachers_json_is_one_line_naming_the_key(teacher_data, tmp_path, edit, words):
    data, tid, _ = _copy(teacher_data, tmp_path)
    text = (data / TEACHERS).read_text()
    if edit is None:
        (data / TEACHERS).write_text(text[:len(text) // 2])
    else:
        index = json.loads(text)
        edit(index, tid)
        (data / TEACHERS).write_text(json.dumps(index))
    line = _one_line(train(data, tmp_path / "run", *DISTILL), *words)
    assert "holds no teachers.json" not in line


@pytest.mark.parametrize("damage", ["float crops with NaN", "a pickle in the text rows"])
def test_damaged_teacher_files_are_counted_and_named(teacher_data, tmp_path, damage, caplog):
    data, tid, names = _copy(teacher_data, tmp_path)
    if damage.startswith("float"):  # was a ValueError in a loader worker
        crops = np.load(data / (names[0] + CROPS)).astype(np.float32)
        crops[:] = np.nan
        np.save(data / (names[0] + CROPS), crops)
        bad = names[0] + CROPS
    else:  # was reported as crops.npy, with numpy's advice to load it unsafely
        np.save(data / (names[0] + teacher_files(tid)[1]), np.array([{"x": 1}], dtype=object), allow_pickle=True)
        bad = names[0] + teacher_files(tid)[1]
    r = train(data, tmp_path / "run", *DISTILL[:3], "train.steps=26", "train.log_every=26", *DISTILL[4:])  # an epoch
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert 45 <= _last(tmp_path / "run")["skipped"]["missing_teacher"] <= 50
    said = [m for m in caplog.messages if "count as missing_teacher" in m]  # once, for the shard
    assert len(said) == 1 and bad in said[0] and "unsafely" not in said[0], said
    if not damage.startswith("float"):
        assert CROPS not in said[0].split(": ", 1)[1]


def _export_with_a_pickled_bin(teacher_data, tmp_path) -> Path:
    out = tmp_path / "export"
    assert run_main("mmpretrain.export", str(teacher_data["teacher"]), "--out", str(out)).returncode == 0
    (out / "open_clip_model.safetensors").unlink()
    (out / "open_clip_pytorch_model.bin").write_bytes(pickle.dumps({"state_dict": object()}))
    return out


def test_a_teacher_that_cannot_load_is_one_line(teacher_data, tmp_path):
    data = teacher_data["data"]
    embed = ("data_tools", "embed", str(data), "--augmentations", "1", "--out", str(tmp_path / "rows"))
    export = _export_with_a_pickled_bin(teacher_data, tmp_path)
    _one_line(run_main(*embed, "--image-model", str(export)), f"--image-model {export}", "pickled objects",
              "mmpretrain.export")  # an UnpicklingError traceback
    run = tmp_path / "run"  # a run folder whose weights are random bytes: a SafetensorError traceback
    shutil.copytree(teacher_data["teacher"], run)
    for f in run.glob("checkpoints/*/model.safetensors"):
        f.write_bytes(np.random.default_rng(0).bytes(1000))
    _one_line(run_main(*embed, "--image-model", str(run)), f"--image-model {run}", "not a readable safetensors")
    line = _one_line(run_main(*embed, "--image-model", str(tmp_path / "nowhere")), "--image-model", "no such folder")
    assert "--model " not in line  # it said "--model '...'"
    assert not (tmp_path / "rows").exists()


def test_export_of_a_run_without_its_model_config_is_one_line(teacher_data, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(teacher_data["teacher"], run)
    (run / "model_config.json").unlink()
    line = _one_line(run_main("mmpretrain.export", str(run), "--out", str(tmp_path / "x")), "model_config.json")
    assert "Errno" not in line


def test_the_same_teacher_under_another_path_is_refused(teacher_data, tmp_path, monkeypatch):
    """Embedded once by its absolute path, then by a relative one: a second, identical ensemble member was
    added without a word."""
    import os

    data, tid, _ = _copy(teacher_data, tmp_path)
    before = sorted(p.name for p in data.iterdir())
    monkeypatch.chdir(tmp_path)
    relative = os.path.relpath(teacher_data["teacher"], tmp_path)
    r = run_main("data_tools", "embed", str(data), "--image-model", relative)
    _one_line(r, "already holds this teacher", tid)
    assert sorted(p.name for p in data.iterdir()) == before
    assert list(json.loads((data / TEACHERS).read_text())["teachers"]) == [tid]


# --------------------------------------------------------------------------- several captions

def test_caption_weights_whose_sum_overflows_are_counted(openmoji, tmp_path):
    """Each weight 1e308 passes, their sum overflows: a worker raised "Total of weights must be finite"."""
    data = tmp_path / "data"
    shutil.copytree(openmoji / "train", data)
    shard = sorted(data.glob("*.tar"))[0]
    out = io.BytesIO()
    with tarfile.open(shard) as t, tarfile.open(fileobj=out, mode="w") as w:
        for m in t.getmembers():
            body = t.extractfile(m).read()
            if m.name.endswith(".json"):
                meta = json.loads(body)
                meta.update(captions=["one more", "and another"], caption_weights=[1e308, 1e308, 1e308])
                body = json.dumps(meta).encode()
            m.size = len(body)
            w.addfile(m, io.BytesIO(body))
    shard.write_bytes(out.getvalue())
    n = json.loads((data / "sizes.json").read_text())[shard.name]
    r = train(data, tmp_path / "run", *QUICK, "train.epochs=1", "train.steps=null", "train.log_every=1",
              "data.num_workers=1")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert _last(tmp_path / "run")["skipped"]["bad_captions"] == n
