import pytest

from conftest import run_cli


@pytest.mark.parametrize(
    "args",
    [
        ("data_tools", "--help"),
        ("data_tools", "build", "--help"),
        ("data_tools", "embed", "--help"),
        ("data_tools", "verify", "--help"),
        ("data_tools", "stats", "--help"),
        ("mmpretrain.train", "--help"),
        ("mmpretrain.eval", "--help"),
        ("mmpretrain.export", "--help"),
    ],
)
def test_help(args):
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    assert "usage:" in r.stdout


def test_bad_arguments_exit_2(tmp_path):
    assert run_cli("data_tools", "build", "nosuch:source", "--out", str(tmp_path / "o")).returncode == 2
    assert run_cli("mmpretrain.eval", "--model", str(tmp_path), "--dataset", str(tmp_path),
                   "--task", "zeroshot_classification").returncode == 2
    assert run_cli("mmpretrain.export", str(tmp_path), "--out", str(tmp_path / "x")).returncode == 2
    r = run_cli("mmpretrain.eval", "--model", str(tmp_path), "--dataset", str(tmp_path / "missing"), "--task", "knn")
    assert r.returncode == 2 and "no such folder" in r.stderr
