"""Evaluation inputs that would give wrong numbers with exit 0, or a traceback: refused in one line."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import run_main


def _wds_copy(openmoji, dst):
    dst.mkdir()
    for f in ("classnames.txt", "zeroshot_classification_templates.txt"):
        shutil.copy(openmoji / f, dst / f)
    shutil.copytree(openmoji / "test", dst / "test", ignore=shutil.ignore_patterns("openmoji-test-*", "*.json"))
    return dst


def test_class_names_shorter_than_the_labels_are_refused(openmoji, tmp_path):
    data = _wds_copy(openmoji, tmp_path / "wds")
    names = (data / "classnames.txt").read_text().splitlines()
    (data / "classnames.txt").write_text("\n".join(names[:3]) + "\n")
    r = run_main("mmpretrain.eval", "--model", "mmpt-tiny-vit", "--dataset", str(data),
                "--task", "zeroshot_classification", "--num_workers", "0", "--output", str(tmp_path / "r.json"))
    assert r.returncode == 1, r.stderr[-2000:]
    assert "but there are 3 class names" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "r.json").exists()


def _rewrite_tar(path, change):
    """Write ``path`` again with each sample passed through ``change(sample) -> sample or None``."""
    import webdataset as wds

    from mmpretrain.data.tar import read_tar

    samples = [c for c in (change(s) for s in read_tar(path)) if c is not None]
    with wds.TarWriter(str(path), encoder=False) as w:
        for s in samples:
            w.write(s)


def _no_classnames(d):
    (d / "classnames.txt").unlink()


def _zero_byte(d):
    (d / "test/0.tar").write_bytes(b"")


def _no_samples(d):
    import tarfile

    tarfile.open(d / "test/0.tar", "w").close()


def _html(d):
    (d / "test/0.tar").write_text("<html><body>404 Not Found</body></html>\n")


def _cut(d):
    data = (d / "test/0.tar").read_bytes()
    (d / "test/0.tar").write_bytes(data[: len(data) // 2 + 100])


def _nshards_large(d):
    (d / "test/nshards.txt").write_text("5\n")


def _nshards_word(d):
    (d / "test/nshards.txt").write_text("five\n")


def _no_captions(d):
    _rewrite_tar(d / "test/0.tar", lambda s: {k: v for k, v in s.items() if k != "txt"})


BROKEN = [  # (change, task, exit code, words of the message)
    (_no_classnames, "zeroshot_classification", 1, "add classnames.txt"),
    (_zero_byte, "zeroshot_classification", 1, "hold no samples"),
    (_no_samples, "zeroshot_classification", 1, "hold no samples"),
    (_html, "zeroshot_classification", 1, "is not a readable tar"),
    (_cut, "zeroshot_classification", 1, "is not a readable tar"),
    (_nshards_large, "zeroshot_classification", 1, "4 of 5 shards missing"),
    (_nshards_word, "zeroshot_classification", 1, "nshards.txt holds 'five'"),
    (_no_captions, "zeroshot_retrieval", 1, "no captions for retrieval"),
]


@pytest.mark.parametrize("change, task, code, words", BROKEN, ids=[b[0].__name__[1:] for b in BROKEN])
def test_broken_eval_data_is_one_clear_line(openmoji, tmp_path, capsys, change, task, code, words):
    from mmpretrain.eval.cli import main

    data = _wds_copy(openmoji, tmp_path / "wds")
    change(data)
    out = tmp_path / "r.json"
    rc = main(["--model", "mmpt-tiny-vit", "--dataset", str(data), "--task", task, "--num_workers", "0",
               "--output", str(out)])
    err = capsys.readouterr().err
    assert rc == code and words in err and "Traceback" not in err, err[-2000:]
    assert not out.exists()


def test_output_that_is_not_a_results_file_is_refused_before_evaluating(openmoji, tmp_path, capsys, monkeypatch):
    import mmpretrain.models.from_disk as loading
    from mmpretrain.eval.cli import main

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    other = tmp_path / "other.json"
    other.write_text('{"foo": 1}')
    (tmp_path / "folder").mkdir()
    for output, words in ((notes, "is not a results file"), (other, "is not a results file"),
                          (tmp_path / "folder", "is a folder"), (notes / "r.json", "is a file, not a folder")):
        rc = main(["--model", "mmpt-tiny-vit", "--dataset", str(openmoji), "--task", "knn", "--output", str(output)])
        err = capsys.readouterr().err
        assert rc == 2 and words in err, err[-2000:]
    assert notes.read_text() == "my notes" and other.read_text() == '{"foo": 1}'


def test_undecodable_eval_images_are_skipped_and_counted(openmoji, tmp_path, capsys):
    from mmpretrain.eval.cli import main

    data = _wds_copy(openmoji, tmp_path / "wds")
    hit = []

    def spoil(s):
        if len(hit) < 2:
            ext = next(k for k in s if k in ("jpg", "png", "webp"))
            s[ext] = b"not an image"
            hit.append(s["__key__"])
        return s

    from mmpretrain.data.tar import tar_keys

    total = len(list(tar_keys(data / "test/0.tar")))
    _rewrite_tar(data / "test/0.tar", spoil)
    out = tmp_path / "r.json"
    rc = main(["--model", "mmpt-tiny-vit", "--dataset", str(data), "--task", "zeroshot_classification",
               "--num_workers", "2", "--output", str(out)])
    err = capsys.readouterr().err
    assert rc == 0, err[-2000:]
    entry = json.loads(out.read_text())["results"][0]
    assert entry["skipped"] == {"undecodable_image": 2} and entry["n"] == total - 2
    assert "skipped {'undecodable_image': 2}" in err
