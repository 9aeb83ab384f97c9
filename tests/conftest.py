"""Tests run offline: HF_HUB_OFFLINE=1, a private Hugging Face cache seeded from the packaged
model, and no network sockets except loopback (gloo uses 127.0.0.1)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from mmpretrain.config.base import DEMO_TEXT_MODEL

from commands import ROOT, accelerate_launch, reset_process_state, run_cli, run_main, script, shared  # noqa: F401

TEXT_MODEL = DEMO_TEXT_MODEL


def pytest_configure(config):
    cache = Path(os.environ.get("MMPT_TEST_HF_HOME", "/tmp/mmpt-test-hf-home"))
    os.environ["HF_HOME"] = str(cache)
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # one of `make test`'s 2 workers on 2 cores: one torch thread each, and one for the processes it
        # starts (2 workers x 2 spinning OpenMP threads took the suite from 681 to 992 CPU-seconds)
        import torch

        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
        return  # the controller seeded the cache before it started the workers
    from mmpretrain.hub_cache import seed_demo_models

    seed_demo_models(cache / "hub")


# what builds data, trains, launches processes or serves on loopback: a test using none of these (and not
# marked integration) is a unit test, run alone by `make test-unit`
INTEGRATION_FIXTURES = {"openmoji", "emoji_images", "ddp_run", "ddp_checks", "http_server", "s3_port", "tiny_model",
                        "digits", "model_state", "retrieval_wds"}


# The most the suite holds on the disk of its temporary folders at once: 4.4 GB on 2 xdist workers (the disk's
# used space every 5 s through `make test`, passing tests' folders removed as they end: pyproject.toml; 3.5 GB
# in one process), with a margin.
DISK_NEED_GB = 6


def pytest_sessionstart(session):
    """Stop at once when the temporary folders' disk cannot hold the suite: a full disk mid-run fails
    the training tests one by one with errors that do not say why (seen in CI)."""
    import shutil
    import tempfile

    if session.config.option.collectonly:
        return
    where = Path(session.config.option.basetemp or tempfile.gettempdir())
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free / 1e9
    if free < DISK_NEED_GB and session.config.option.markexpr != "unit" and not os.environ.get("MMPT_TEST_LOW_DISK"):
        pytest.exit(f"{where} has {free:.1f} GB free; the suite needs ~{DISK_NEED_GB} GB there: free space (old "
                    f"/tmp/pytest-of-*/ folders) or pass --basetemp on a larger disk (MMPT_TEST_LOW_DISK=1: run "
                    "anyway)", returncode=3)


# The longest modules first (`--durations`), in an order that keeps both workers busy: pytest-xdist
# (`--dist loadscope --no-loadscope-reorder`) hands modules out in collection order. stream_fill builds the
# session's data and its 2-rank launch (ddp_checks) while the other worker runs modules that need neither;
# the engines, which read that launch's run, come after.
FIRST = ("test_stream_fill.py", "test_crop.py", "test_openmoji_all.py", "test_experiment.py", "test_crash.py",
         "test_rank_failure.py", "test_engines.py", "test_data_sources.py", "test_eval_selection.py", "test_cli.py",
         "test_eval.py", "test_slice.py", "test_train.py")


# the modules whose 2-rank checks run in tests/ddp_helpers.py's pool of spawned ranks: one worker takes them
# all, so that the pool (2 interpreters importing torch and the test module, ~16 CPU-seconds) starts once
RANK_POOL = {p.name for p in Path(__file__).parent.glob("test_*.py") if "run_ranks" in p.read_text()}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's ``loadscope`` (a module's tests on one worker, for its module fixtures), with the
    :data:`RANK_POOL` modules as one unit."""
    from xdist.scheduler import LoadScopeScheduling

    class Modules(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "rank_pool" if Path(module).name in RANK_POOL else module

    return Modules(config, log)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: FIRST.index(item.path.name) if item.path.name in FIRST else len(FIRST))
    for item in items:
        if not (set(item.fixturenames) & INTEGRATION_FIXTURES or item.get_closest_marker("integration")
                or item.get_closest_marker("slow")):
            item.add_marker(pytest.mark.unit)


@pytest.fixture(autouse=True)
def _no_network():
    import pytest_socket

    pytest_socket.socket_allow_hosts(["127.0.0.1", "localhost", "::1"], allow_unix_socket=True)
    yield
    pytest_socket.enable_socket()


# --------------------------------------------------------------------------- training in a test

CONFIG = ROOT / "configs/demo.yaml"
# the tests' micro image tower on the demo config (its 6 x 256-wide ViT -> 2 x 64): every mechanism the
# demo's runs exercise, a fraction of their compute and checkpoint bytes; test_demo.py trains the demo's own
MICRO = ["model.overrides={embed_dim: 64, vision_cfg: {width: 64, layers: 2, head_width: 32}}"]
DEMO_TOWER = ["model.overrides={}"]  # after MICRO: the demo config's own tower (a test of its widths or layers)
# no end-of-run plots (1.4 of a short run's ~2.2 s; test_train.py's observability test draws them)
SHORT = ["train.epochs=null", "optim.warmup_steps=1", "train.progress=false", "train.log_with=[]", "train.plots=false"]


def train(data: Path, run_dir: Path, *overrides: str, config: Path = CONFIG) -> subprocess.CompletedProcess:
    """``python -m mmpretrain.train --config CONFIG data.train=DATA run_dir=RUN_DIR`` with a short run's
    settings (:data:`SHORT`: steps, not epochs; one warm-up step; no progress bar, trackers or plots), the
    micro tower on the demo config (:data:`MICRO`) and ``overrides`` after them, through :func:`run_main`.
    ``data``: the training data (a folder or spec)."""
    micro = MICRO if config == CONFIG else []  # a shipped config of its own runs as shipped
    return run_main("mmpretrain.train", "--config", str(config), f"data.train={data}", f"run_dir={run_dir}", *SHORT,
                    *micro, *overrides)


def setup_run(data: Path, run_dir: Path, *overrides: str, config: Path = CONFIG):
    """The trainer's ``setup`` for the same command (a ``Run`` to inspect, patch, then ``fit``), in this
    process with accelerate's state reset first."""
    from mmpretrain.config import load_config
    from mmpretrain.train import setup

    reset_process_state()
    micro = MICRO if config == CONFIG else []
    return setup(load_config(config, [f"data.train={data}", f"run_dir={run_dir}", *SHORT, *micro, *overrides]))


def launch(run_dir: Path, data: Path, *overrides: str, accelerate: str = "cpu-2proc", launch_args: tuple = (),
           wrapper: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """``accelerate launch --config_file configs/accelerate/ACCELERATE --num_processes 2 [-m mmpretrain.train
    | WRAPPER mmpretrain.train] --config demo.yaml data.train=DATA run_dir=RUN_DIR ...`` as a user
    launches it: 2 processes (gloo on a CPU)."""
    cmd = [*accelerate_launch(accelerate), "--num_processes", "2", *launch_args,
           *([wrapper] if wrapper else ["-m"]), "mmpretrain.train", "--config", str(CONFIG), f"data.train={data}",
           f"run_dir={run_dir}", "train.progress=false", "train.log_with=[]", "train.plots=false", *overrides]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})


# the demo config for 4 steps in one process, checkpoints at 2 and 4 (the checkpoint and export tests' run)
DEMO_RUN = ["data.batch_size=16", "data.num_workers=0", "train.log_every=1", "train.save_every=2", "train.keep_last=5"]


@pytest.fixture(scope="session")
def demo_run(openmoji, tmp_path_factory) -> Path:
    """The demo config trained 4 steps (:data:`DEMO_RUN`) through the trainer's main in this process.
    Shared: a test that changes it works on its own copy."""
    def make(folder: Path):
        run_dir = folder / "run"
        r = train(openmoji / "train", run_dir, "train.steps=4", *DEMO_RUN)
        assert r.returncode == 0, r.stderr[-3000:]
        return run_dir

    return shared(tmp_path_factory, "demo_run", make)


# 6 steps on 2 ranks, checkpoints at 3 and 6: the data-parallel reference of the engine tests, and the run
# the 2-rank evaluation reads
DDP_RUN = ["train.steps=6", "train.epochs=null", "data.batch_size=16", "data.num_workers=1", "data.shuffle_buffer=32",
           "optim.warmup_steps=1", "train.log_every=1", "train.save_every=3"]
# the evaluation of that run under the same launcher (and, in test_slice.py, in one process)
DDP_EVAL = ["--dataset", "{data}", "{data}", "--task", "zeroshot_classification", "clustering", "--batch_size", "8",
            "--num_workers", "1"]


# one epoch of 4 shards (one damaged, :func:`damaged`) at 20 a rank, no spare sample: tests/reliability/
# test_stream_fill.py, and on 2 ranks x 2 workers in the ddp_checks launch
BAD_SHARD_RUN = ["train.epochs=1", "train.steps=null", "data.batch_size=20", "optim.warmup_steps=1", "train.log_every=1",
                 "train.progress=false", "train.log_with=[]", "train.plots=false"]
HTML_PAGE = b"<html><head><title>502 Bad Gateway</title></head><body>nginx</body></html>\n" * 40


def damaged(openmoji: Path, dest: Path, kind: str, bad: int = 2) -> str:
    """A copy of the OpenMoji training shards whose shard ``bad`` is an HTML error page ("html": an
    unreadable shard, as a failed download saves it) or whose caption-embedding sidecar is cut short
    ("sidecar"); returns the ``data.train`` pattern of its first 4 shards."""
    import shutil

    shutil.copytree(openmoji / "train", dest)
    names = sorted(p.name for p in dest.glob("*.tar"))
    if kind == "html":
        (dest / names[bad]).write_bytes(HTML_PAGE)
    else:
        side = dest / f"{names[bad]}.emb.npy"
        side.write_bytes(side.read_bytes()[:300])
    return str(dest / f"{names[0].rsplit('-', 1)[0]}-{{000000..000003}}.tar")


@pytest.fixture(scope="session")
def ddp_checks(openmoji, emoji_images, demo_run, tmp_path_factory) -> dict:
    """One ``accelerate launch`` of 2 CPU processes (each launch costs ~15 s of process start-up and
    imports on 2 cores) running tests/scripts/ddp_checks.py's plan: ``python -m mmpretrain.train``'s
    main on the demo config for 6 steps (:data:`DDP_RUN`, into ``run_dir``), ``python -m
    mmpretrain.eval``'s main on that run (:data:`DDP_EVAL`, into ``eval_output``; the launch's printed
    tables in ``stdout``), then the DDP checks, then the plan's ``runs``: the damaged-shard epochs, LoRA, and
    ``python -m data_tools build`` then ``embed`` (captions and ``demo_run`` as a teacher) of a captions TSV
    with broken rows (``build_tsv``) into ``build_out`` (tests/test_data_sources.py). Returns the script's
    report with those keys."""
    def make(folder: Path):
        import json

        from data_copies import broken_tsv

        out = folder
        (out / "tsv").mkdir()
        tsv = broken_tsv(out / "tsv", emoji_images, good_rows=250)  # 6 shards of 50 rows, each rank its part
        run_dir = out / "run"
        runs = [{"name": f"bad_{kind}", "args": ["--config", str(CONFIG), f"data.train={damaged(openmoji, out / kind, kind)}",
                                                f"run_dir={out / ('run_' + kind)}", *BAD_SHARD_RUN, "data.num_workers=2"]}
                for kind in ("html", "sidecar")]
        runs.append({"name": "lora", "args": ["--config", str(CONFIG), f"data.train={openmoji / 'train'}",
                                              f"run_dir={out / 'run_lora'}", "train.progress=false", "train.log_with=[]",
                                              "train.plots=false", *DDP_RUN, "train.steps=2", "train.save_every=null",
                                              "model.lora={towers: [image]}"]})
        runs += [{"name": "build", "module": "data_tools", "args": ["build", str(tsv), "--out", str(out / "built"),
                                                                    "--image-size", "32", "--shard-size", "50",
                                                                    "--workers", "1"]},
                 {"name": "embed", "module": "data_tools", "args": ["embed", str(out / "built"), "--model", TEXT_MODEL,
                                                                    "--image-model", str(demo_run), "--augmentations",
                                                                    "2"]}]
        plan = {"train": ["--config", str(CONFIG), f"data.train={openmoji / 'train'}", f"run_dir={run_dir}",
                          "train.progress=false", "train.log_with=[]", "train.plots=false", *DDP_RUN], "runs": runs,
                "eval": ["--model", str(run_dir), *(a.format(data=openmoji) for a in DDP_EVAL), "--output",
                         str(out / "eval.json")],
                "checks": ["unused", "masks", "steps", "nonfinite"], "data": str(openmoji / "train"), "work": str(out / "checks"),
                "report": str(out / "report.json")}
        (out / "plan.json").write_text(json.dumps(plan))
        cmd = [*accelerate_launch(), str(ROOT / "tests/scripts/ddp_checks.py"), str(out / "plan.json")]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-4000:]
        report = json.loads((out / "report.json").read_text())
        assert report.get("train_exit") == 0 and report.get("eval_exit") == 0, (report, r.stderr[-4000:])
        return {**report, "run_dir": run_dir, "eval_output": out / "eval.json", "stdout": r.stdout,
                "run_dirs": {name: out / f"run_{name.removeprefix('bad_')}" for name in ("bad_html", "bad_sidecar", "lora")},
                "build_tsv": tsv, "build_out": out / "built"}

    return shared(tmp_path_factory, "ddp_checks", make)


@pytest.fixture(scope="session")
def ddp_run(ddp_checks) -> Path:
    """The demo config trained 6 steps by 2 CPU ranks under ``accelerate launch`` (DDP); tests read it."""
    return ddp_checks["run_dir"]


@pytest.fixture(scope="session")
def emoji_images(tmp_path_factory) -> list[tuple[Path, str]]:
    """20 real emoji renders as JPEG/PNG files with their Unicode-name captions."""
    from data_tools.sources.openmoji import Renderer, list_emoji

    folder = tmp_path_factory.mktemp("emoji")
    render = Renderer()
    out = []
    for i, e in enumerate(list_emoji(20)):
        path = folder / f"{e.key}.{'jpg' if i % 2 else 'png'}"
        render(e.text).resize((48, 48)).save(path)
        out.append((path, e.name))
    return out


@pytest.fixture(scope="session")
def openmoji(tmp_path_factory) -> Path:
    """A small real dataset: 500 OpenMoji emoji, built and embedded through the public commands."""
    def make(folder: Path):
        out = folder / "openmoji"
        r = run_main("data_tools", "build", "demo:openmoji", "--out", str(out), "--image-size", "32",
                    "--shard-size", "50", "--limit", "500")
        assert r.returncode == 0, r.stderr
        r = run_main("data_tools", "embed", str(out), "--model", TEXT_MODEL)
        assert r.returncode == 0, r.stderr
        return out

    return shared(tmp_path_factory, "openmoji", make)


@pytest.fixture(scope="session")
def sugar_crepe(openmoji, tmp_path_factory) -> Path:
    """SugarCrepe's layout (val2017/ + swap_obj.json, replace_obj.json) from the held-out emoji, negatives
    made by `data_tools negatives --layout sugar_crepe`."""
    def make(folder: Path):
        out = folder / "sc"
        r = run_main("data_tools", "negatives", str(openmoji / "test"), "--out", str(out), "--layout", "sugar_crepe")
        assert r.returncode == 0, r.stderr
        return out

    return shared(tmp_path_factory, "sugar_crepe", make)


@pytest.fixture(scope="session")
def winoground(openmoji, tmp_path_factory) -> Path:
    """Winoground's layout as clip_benchmark reads it (image_0, image_1, caption_0, caption_1 and the other
    columns of facebook/winoground), saved with save_to_disk: pairs of held-out emoji."""
    def make(folder: Path):
        import io

        import datasets
        from PIL import Image

        from mmpretrain.data.tar import read_tar

        samples = [(Image.open(io.BytesIO(s["png"])).convert("RGB"), s["txt"].decode())
                   for shard in sorted((openmoji / "test").glob("*.tar")) for s in read_tar(shard) if "png" in s]
        pairs = [(samples[i], samples[i + 1]) for i in range(0, len(samples) - 1, 2)][:40]
        rows = {"id": list(range(len(pairs))), "image_0": [a[0] for a, _ in pairs], "image_1": [b[0] for _, b in pairs],
                "caption_0": [a[1] for a, _ in pairs], "caption_1": [b[1] for _, b in pairs],
                "tag": ["object"] * len(pairs), "secondary_tag": [""] * len(pairs),
                "num_main_preds": [1] * len(pairs), "collapsed_tag": ["Object"] * len(pairs)}
        features = datasets.Features({"id": datasets.Value("int32"), "image_0": datasets.Image(), "image_1": datasets.Image(),
                                      "caption_0": datasets.Value("string"), "caption_1": datasets.Value("string"),
                                      "tag": datasets.Value("string"), "secondary_tag": datasets.Value("string"),
                                      "num_main_preds": datasets.Value("int32"), "collapsed_tag": datasets.Value("string")})
        out = folder / "winoground"
        datasets.DatasetDict({"test": datasets.Dataset.from_dict(rows, features=features)}).save_to_disk(str(out))
        return out

    return shared(tmp_path_factory, "winoground", make)


# a teacher of the experiment grid's kind: the packaged ViT with a trainable open_clip text tower
TEACHER = ["model.arch=mmpt-tiny-vit", "model.lock_text=false", "model.text_from_targets=false",
           "data.batch_size=16", "data.num_workers=0", "loss=[{name: clip}]"]


@pytest.fixture(scope="session")
def teacher_data(openmoji, tmp_path_factory) -> dict:
    """A teacher trained 3 steps on the OpenMoji shards, and a copy of those shards embedded with it
    (3 crops an image): the teacher-row tests' and the filter's data."""
    def make(folder: Path):
        import json
        import shutil

        root = folder
        r = train(openmoji / "train", root / "teacher", "train.steps=3", *TEACHER)
        assert r.returncode == 0, r.stderr[-3000:]
        data = root / "data"
        shutil.copytree(openmoji / "train", data)
        r = run_main("data_tools", "embed", str(data), "--image-model", str(root / "teacher"), "--augmentations", "3")
        assert r.returncode == 0, r.stderr[-3000:]
        return {"root": root, "teacher": root / "teacher", "data": data, "out": json.loads(r.stdout)}

    return shared(tmp_path_factory, "teacher_data", make)
