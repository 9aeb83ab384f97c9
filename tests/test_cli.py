"""Every command's help and its answer to bad arguments (exit 2). Each entry point -- every ``python -m``
module of the packages and every console script pyproject.toml installs -- runs --help as a user runs
it, in a new interpreter (it must answer without the trainer's imports); the subcommands' help and the
refusals run the same ``main`` in this process."""

import ast
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import tomllib

from conftest import ROOT, run_cli, run_main

PACKAGES = ("mmpretrain", "data_tools")


def _module_entries() -> list[str]:
    """The ``python -m`` entries: every package with a ``__main__.py`` and every module with a top-level
    ``if __name__ == "__main__":`` (found in the source, so that a new one is tested without listing it)."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            if path.name == "__main__.py":
                found.append(name[: -len(".__main__")])
            elif any(isinstance(node, ast.If) and "__name__" in ast.unparse(node.test) and "__main__" in
                     ast.unparse(node.test) for node in ast.parse(path.read_text()).body):
                found.append(name)
    return found


def _console_scripts() -> dict[str, str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def test_the_entries_are_found():
    assert {"data_tools", "mmpretrain.train", "mmpretrain.eval", "mmpretrain.export",
            "mmpretrain.hub_cache"} <= set(_module_entries())
    assert set(_console_scripts()) == {"mmpretrain-train", "mmpretrain-eval", "mmpretrain-export", "mmpretrain-data"}


@pytest.mark.parametrize("module", _module_entries())
@pytest.mark.integration  # starts processes (or builds real data): not in make test-unit
def test_help(module):
    r = run_cli(module, "--help")
    assert r.returncode == 0, r.stderr
    assert "usage:" in r.stdout


@pytest.mark.parametrize("name", sorted(_console_scripts()))
@pytest.mark.integration
def test_console_script_help(name):
    """The installed script (what ``pip install`` put beside the interpreter) and its target: the same
    ``main`` as the ``python -m`` entry, so both answer alike."""
    target = _console_scripts()[name]
    installed = {ep.name: ep.value for ep in entry_points(group="console_scripts") if ep.name == name}
    assert installed.get(name) == target, f"{name}: installed {installed.get(name)}, pyproject says {target}: reinstall"
    exe = Path(sys.executable).parent / name
    r = subprocess.run([str(exe), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "usage:" in r.stdout
    module = target.split(":")[0].removesuffix(".cli")
    assert r.stdout == run_main(module, "--help").stdout  # the python -m entry's parser (each names its prog)


def test_package_data_is_there():
    """Every package-data pattern names files that exist (a pattern matching nothing ships nothing)."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for package, patterns in data.items():
        for pattern in patterns:
            assert list((ROOT / package).glob(pattern)), f"package-data {package}: {pattern} matches no file"


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


def test_a_normal_run_prints_no_library_load_reports(openmoji, tmp_path):
    """Offline, as the demo runs: embedding a dataset and 2 training steps of the demo config print no
    library load report (transformers' table of the MiniLM pooler weights a mean-pooled tower leaves
    unused), no weight-loading progress bar, and no "Could not reach the Hub" for the offline mode the
    user chose. A fresh interpreter, since the libraries' log handlers hold the process's real stderr."""
    import shutil
    import subprocess
    import sys

    from conftest import MICRO, ROOT, TEXT_MODEL

    data = tmp_path / "data"
    data.mkdir()
    for p in (openmoji / "train").iterdir():
        if p.suffix == ".tar" or p.name == "sizes.json":
            shutil.copy(p, data / p.name)
    code = ("import sys; from data_tools.cli import main as data_tools; from mmpretrain.train.cli import main as "
            f"train; sys.exit(data_tools(['embed', {str(data)!r}, '--model', {TEXT_MODEL!r}]) or train(['--config', "
            f"{str(ROOT / 'configs/demo.yaml')!r}, 'data.train={data}', 'run_dir={tmp_path / 'run'}', 'train.steps=2', "
            f"'train.epochs=null', 'data.num_workers=0', 'optim.warmup_steps=1', 'train.progress=false', {MICRO[0]!r}]))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    printed = r.stdout + r.stderr
    for noise in ("UNEXPECTED", "LOAD REPORT", "Could not reach the Hub", "Loading weights"):
        assert noise not in printed, (noise, printed[-3000:])
    assert (tmp_path / "run/checkpoints/step_00000002").is_dir()


def test_the_load_report_filter_keeps_every_other_report():
    """Only a report of unused pooler weights is dropped: missing or mismatched weights still print."""
    import logging

    from mmpretrain.hub_cache import _UnusedPooler

    def report(*rows):
        table = "Key | Status |  | \n----+----+--+-\n" + "".join(f"{k} | {s} |  | \n" for k, s in rows)
        return logging.LogRecord("transformers.modeling_utils", logging.WARNING, "", 0,
                                 "BertModel LOAD REPORT from: x\n" + table, None, None)

    keep = _UnusedPooler().filter
    assert not keep(report(("pooler.dense.weight", "UNEXPECTED"), ("pooler.dense.bias", "UNEXPECTED")))
    assert keep(report(("pooler.dense.weight", "UNEXPECTED"), ("encoder.layer.0.attention.self.query.weight", "MISSING")))
    assert keep(report(("embeddings.word_embeddings.weight", "MISMATCH")))
    assert keep(logging.LogRecord("transformers.modeling_utils", logging.WARNING, "", 0, "another warning", None, None))
