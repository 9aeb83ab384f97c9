"""Every command's help and its answer to bad arguments (exit 2). Each entry point's --help runs as a
user runs it, in a new interpreter (it must answer without the trainer's imports); the subcommands'
help and the refusals run the same ``main`` in this process."""

import pytest

from conftest import run_cli, run_main


@pytest.mark.parametrize("args", [("data_tools", "--help"), ("mmpretrain.train", "--help"),
                                  ("mmpretrain.eval", "--help"), ("mmpretrain.export", "--help")])
def test_help(args):
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    assert "usage:" in r.stdout


@pytest.mark.parametrize("sub", ["build", "embed", "verify", "stats"])
def test_subcommand_help(sub):
    r = run_main("data_tools", sub, "--help")
    assert r.returncode == 0, r.stderr
    assert "usage:" in r.stdout


def test_bad_arguments_exit_2(tmp_path):
    assert run_main("data_tools", "build", "nosuch:source", "--out", str(tmp_path / "o")).returncode == 2
    assert run_main("mmpretrain.eval", "--model", str(tmp_path), "--dataset", str(tmp_path),
                    "--task", "zeroshot_classification").returncode == 2
    assert run_main("mmpretrain.export", str(tmp_path), "--out", str(tmp_path / "x")).returncode == 2
    r = run_main("mmpretrain.eval", "--model", str(tmp_path), "--dataset", str(tmp_path / "missing"), "--task", "knn")
    assert r.returncode == 2 and "no such folder" in r.stderr
