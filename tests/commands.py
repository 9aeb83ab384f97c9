"""How the tests run commands: ``python -m MODULE`` in this process (:func:`run_main`) or in a new
interpreter (:func:`run_cli`), ``accelerate launch`` on a free port, and data made once for the whole run
(:func:`shared`, also across pytest-xdist's workers). tests/conftest.py re-exports them."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def shared(tmp_path_factory, name: str, make):
    """``make(folder)`` once for the whole test run, for a session fixture: in one process, in a new
    temporary folder; under pytest-xdist (``make test`` runs 2 workers), by whichever worker asks first,
    into a folder beside the workers' own, while a worker asking meanwhile waits for it and then reads the
    result (saved as JSON: ``make`` returns paths, strings, numbers, lists and dicts of them)."""
    import json
    import shutil

    from filelock import FileLock

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return make(tmp_path_factory.mktemp(name))
    root = tmp_path_factory.getbasetemp().parent
    folder, saved = root / f"shared-{name}", root / f"shared-{name}.json"
    with FileLock(str(root / f"shared-{name}.lock")):
        if saved.is_file():
            return json.loads(saved.read_text(), object_hook=lambda d: Path(d["__path__"]) if "__path__" in d else d)
        shutil.rmtree(folder, ignore_errors=True)  # a worker's attempt that failed
        folder.mkdir()
        result = make(folder)
        saved.write_text(json.dumps(result, default=lambda o: {"__path__": str(o)} if isinstance(o, Path) else o))
        return result


def accelerate_launch(accelerate: str = "cpu-2proc") -> list[str]:
    """``python -m accelerate.commands.launch --config_file configs/accelerate/ACCELERATE.yaml
    --main_process_port 0`` (a free port): accelerate's default, 29500, is refused while another launch of
    the run (the other xdist worker's) holds it."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            str(ROOT / f"configs/accelerate/{accelerate}.yaml"), "--main_process_port", "0"]


def run_cli(*args: str, cwd: Path | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``python -m ...`` as a user would, in a new interpreter, with the test environment. For tests
    about the process itself (its exit status, what a fresh interpreter imports, a kill, a launcher);
    every other command-line test uses :func:`run_main`."""
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd or ROOT, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ))


def script(path: str):
    """A script of the repository (``scripts/reports/evidence.py``) as a module, loaded from its file: the
    scripts are run by path, not installed, so its folder goes on ``sys.path`` as ``python PATH`` puts it
    there (for its siblings' imports)."""
    import importlib.util

    file = ROOT / path
    if str(file.parent) not in sys.path:
        sys.path.insert(0, str(file.parent))
    spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MAINS = {"mmpretrain.train": "mmpretrain.train.cli", "mmpretrain.eval": "mmpretrain.eval.cli",
         "mmpretrain.export": "mmpretrain.export.cli", "data_tools": "data_tools.cli"}


@contextlib.contextmanager
def _captured_fds():
    """stdout and stderr at the file-descriptor level, for this process and the processes it forks (the
    loader workers), as a new interpreter's pipes would hold them: yields ``[out, err]``, filled on exit."""
    import tempfile

    got = ["", ""]
    files = [tempfile.TemporaryFile(mode="w+b"), tempfile.TemporaryFile(mode="w+b")]
    saved_streams = sys.stdout, sys.stderr
    for stream in saved_streams:
        stream.flush()
    saved_fds = [os.dup(1), os.dup(2)]
    try:
        os.dup2(files[0].fileno(), 1)
        os.dup2(files[1].fileno(), 2)
        sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
        sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
        yield got
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = saved_streams
        os.dup2(saved_fds[0], 1)
        os.dup2(saved_fds[1], 2)
        for fd in saved_fds:
            os.close(fd)
        for i, f in enumerate(files):
            f.seek(0)
            got[i] = f.read().decode("utf-8", "replace")
            f.close()


def reset_process_state() -> None:
    """What one ``python -m`` run leaves behind in this process and the next would inherit: accelerate's
    process-wide state (an Accelerator is a per-process singleton)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def run_main(*args: str) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGS`` (MODULE: mmpretrain.train, mmpretrain.eval, mmpretrain.export or
    data_tools) through the same ``main`` in this process, without a new interpreter's ~9 s of imports:
    its exit status (2 for an argparse error, 1 with the traceback on stderr for an exception that
    would have ended the interpreter), stdout and stderr (the loader workers' too)."""
    import importlib
    import traceback

    module, argv = importlib.import_module(MAINS[args[0]]), list(args[1:])
    reset_process_state()
    code = 0
    try:
        with _captured_fds() as got:
            try:
                code = module.main(argv)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except Exception:
                traceback.print_exc()
                code = 1
    finally:
        reset_process_state()
    return subprocess.CompletedProcess([args[0], *argv], code, got[0], got[1])
