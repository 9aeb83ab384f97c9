"""Evaluation inputs that would give wrong numbers with exit 0, or a traceback: refused in one line."""

from __future__ import annotations

import shutil

from conftest import run_cli


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
    r = run_cli("mmpretrain.eval", "--model", "mmpt-tiny-vit", "--dataset", str(data),
                "--task", "zeroshot_classification", "--num_workers", "0", "--output", str(tmp_path / "r.json"))
    assert r.returncode == 1, r.stderr[-2000:]
    assert "but there are 3 class names" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "r.json").exists()
