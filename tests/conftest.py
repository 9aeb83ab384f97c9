"""Tests run offline: HF_HUB_OFFLINE=1, a private Hugging Face cache seeded from the packaged
model, and no network sockets except loopback (gloo uses 127.0.0.1)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))  # test helpers shared with the benchmarks (clip_benchmark_anchor)
TEXT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def pytest_configure(config):
    cache = Path(os.environ.get("MMPT_TEST_HF_HOME", "/tmp/mmpt-test-hf-home"))
    os.environ["HF_HOME"] = str(cache)
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from mmpretrain.hub_cache import seed_demo_models

    seed_demo_models(cache / "hub")


@pytest.fixture(autouse=True)
def _no_network():
    import pytest_socket

    pytest_socket.socket_allow_hosts(["127.0.0.1", "localhost", "::1"], allow_unix_socket=True)
    yield
    pytest_socket.enable_socket()


def run_cli(*args: str, cwd: Path | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``python -m ...`` as a user would, with the test environment."""
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd or ROOT, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ))


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
    out = tmp_path_factory.mktemp("data") / "openmoji"
    r = run_cli("data_tools", "build", "demo:openmoji", "--out", str(out), "--image-size", "32",
                "--shard-size", "50", "--limit", "500")
    assert r.returncode == 0, r.stderr
    r = run_cli("data_tools", "embed", str(out), "--model", TEXT_MODEL)
    assert r.returncode == 0, r.stderr
    return out


def in_tar_copy(src: Path, dst: Path) -> Path:
    """A copy of a sidecar-embedded dataset folder in the earlier layout: each sample's embedding as an
    in-tar ``{key}.emb.npy`` member, no sidecar files (datasets embedded before the sidecars look so)."""
    import io
    import json
    import shutil

    import numpy as np
    import webdataset as wds

    from mmpretrain.data.tar import read_tar

    dst.mkdir(parents=True)
    index = json.loads((src / "embeddings.json").read_text())
    for name in index["shards"]:
        rows = np.load(src / f"{name}.emb.npy")
        with wds.TarWriter(str(dst / name), encoder=False) as w:
            for sample, row in zip(read_tar(src / name), rows):
                buf = io.BytesIO()
                np.save(buf, row)
                w.write({**sample, "emb.npy": buf.getvalue()})
    shutil.copy(src / "sizes.json", dst / "sizes.json")
    manifest = json.loads((src / "manifest.json").read_text())
    manifest["embedding"].pop("layout", None)
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def extract_images(dataset: Path, shards: int, dest: Path) -> list[tuple[str, str]]:
    """The PNG images and captions of a built dataset's first ``shards`` training shards, written as files
    into ``dest``: ``[(caption, file name)]`` (real images for the tests that need a folder or a server)."""
    import tarfile

    dest.mkdir(parents=True, exist_ok=True)
    rows = []
    for shard in sorted((dataset / "train").glob("*.tar"))[:shards]:
        with tarfile.open(shard) as t:
            members = {m.name: t.extractfile(m).read() for m in t.getmembers() if m.isfile()}
        for name, data in members.items():
            if name.endswith(".png"):
                (dest / name).write_bytes(data)
                rows.append((members[name[:-4] + ".txt"].decode(), name))
    return rows
