"""Remote shards under faults, against real servers on loopback: Python's http.server (with byte
ranges) read through fsspec's HTTP filesystem, and moto's S3 server read through s3fs, each behind a
fault proxy that drops connections mid-answer, answers 503, or stalls past the timeout. For every
fault kind: every sample delivered once, in order, with the local bytes; the retries counted."""

from __future__ import annotations

import json
import logging
import socket
from collections import Counter

import pytest
from data_copies import extract_images
from remote_servers import FAKE_AWS, FaultProxy, RangeHTTPServer, moto_s3

from mmpretrain.config import ConfigError, RemoteConfig, load_config
from mmpretrain.data import urls
from mmpretrain.data.tar import read_tar

from conftest import ROOT

FAULTS = {"none": (None, {}), "drop": ("drop", {"after": 20_000, "times": 3}), "503": ("503", {"times": 2}),
          "stall": ("stall", {"after": 10_000, "times": 2, "stall": 2.0})}
# retries each costs, on both servers: a dropped or stalled read one each (resumed by a range request);
# the two 503s hit one open (fsspec's HTTP info tries HEAD then GET, s3fs HeadObject then a listing)
RETRIES = {"none": 0, "drop": 3, "503": 1, "stall": 2}


@pytest.fixture
def fast_retries():
    """Remote options with a short backoff and a 1 s timeout (the stall fault lasts 2 s), given fsspec's
    ``storage_options``; the retry count starts at 0."""
    urls.take_retries()

    def options(**storage_options) -> RemoteConfig:
        return RemoteConfig(retries=5, backoff=0.05, timeout=1.0, storage_options=storage_options)

    return options


@pytest.fixture(scope="module")
def http_server(openmoji):
    server = RangeHTTPServer(openmoji)
    yield server
    server.close()


def local_samples(openmoji) -> dict[str, list[dict]]:
    names = sorted(json.loads((openmoji / "train/sizes.json").read_text()))[:3]
    return {n: list(read_tar(openmoji / "train" / n)) for n in names}


def check_delivery(local: dict[str, list[dict]], url_of, remote: RemoteConfig) -> None:
    for name, samples in local.items():
        got = list(read_tar(url_of(name), remote=remote))
        assert [s["__key__"] for s in got] == [s["__key__"] for s in samples]  # each once, in order
        assert got == samples  # byte for byte


def survives(openmoji, port: int, fault: str, url_of, server: str, remote_of) -> None:
    """Every sample of 3 shards through a proxy injecting ``fault``: delivered once, in order, byte for
    byte; the faults injected and the retries they cost as expected. ``remote_of(proxy)``: the options."""
    kind, kw = FAULTS[fault]
    proxy = FaultProxy(port, kind, **kw)
    try:
        check_delivery(local_samples(openmoji), lambda n: url_of(proxy, n), remote_of(proxy))
        retries = urls.take_retries()
        print(f"{server} {fault}: retries {retries}, faults {proxy.faults}")
        assert proxy.faults == kw.get("times", 0) and retries == RETRIES[fault]
    finally:
        proxy.close()


@pytest.mark.parametrize("fault", list(FAULTS))
def test_http_shards_survive_each_fault(openmoji, http_server, fast_retries, fault):
    survives(openmoji, http_server.port, fault, lambda proxy, n: f"{proxy.url}/train/{n}", "http",
             lambda proxy: fast_retries())


@pytest.fixture(scope="module")
def s3_port(openmoji):
    with pytest.MonkeyPatch.context() as mp, moto_s3(mp, "shards", openmoji / "train", "train") as port:
        yield port


@pytest.mark.parametrize("fault", list(FAULTS))
def test_s3_shards_survive_each_fault(openmoji, s3_port, fast_retries, fault, monkeypatch):
    for k, v in FAKE_AWS.items():
        monkeypatch.setenv(k, v)

    survives(openmoji, s3_port, fault, lambda proxy, name: f"s3://shards/train/{name}", "s3",
             lambda proxy: fast_retries(client_kwargs={"endpoint_url": proxy.url}))  # s3fs reaches the store through the proxy


def test_the_training_stream_over_a_faulty_server_is_the_local_stream(openmoji, http_server, fast_retries):
    """2 ranks x 2 forked loader workers reading over HTTP through dropped connections: the same batches,
    bit for bit, as from the local folder, the retries counted with the skips; and a resume from a
    mid-epoch position continues it exactly."""
    from test_loader import _batches, _plan, _same

    from mmpretrain.data.position import StreamPosition

    names = sorted(json.loads((openmoji / "train/sizes.json").read_text()))
    proxy = FaultProxy(http_server.port, "drop", after=20_000, times=6)
    try:
        spec = f"{proxy.url}/train/openmoji-train-{{000000..{len(names) - 1:06d}}}.tar"
        local, far = _plan(openmoji / "train"), _plan(spec, remote=fast_retries())
        # sizes.json and sidecars read over HTTP
        assert [s.size for s in far.shards] == [s.size for s in local.shards] and far.shards[0].embeddings is not None
        skipped = Counter()
        for rank in range(2):
            a, b = _batches(local, rank, 6), _batches(far, rank, 6)
            for x, y in zip(a, b):
                _same(x, y)
                skipped.update(y.skipped)
            pos = StreamPosition(far)
            for batch in b[:3]:
                pos.advance(batch)
            for x, y in zip(a[3:], _batches(far, rank, 3, start=pos.state())):
                _same(x, y)
        assert proxy.faults == 6
        assert 0 < skipped["remote_retries"] <= 6
        assert set(skipped) <= {"remote_retries", "dropped_remainder"}  # nothing lost
    finally:
        proxy.close()


def test_data_remote_is_handed_to_every_read_of_the_run(openmoji, http_server):
    """data.remote is an argument, not a process-wide setting: setup's sources carry the config's options to
    every shard record of the plan and to the sidecars beside them, and a read of a failing shard gives
    up after data.remote.retries."""
    from mmpretrain.train.inputs import build_data, load_sources

    names = sorted(json.loads((openmoji / "train/sizes.json").read_text()))
    proxy = FaultProxy(http_server.port, "503", times=10**6)
    try:
        good = f"http://127.0.0.1:{http_server.port}/train/openmoji-train-{{000000..{len(names) - 1:06d}}}.tar"
        cfg = load_config(ROOT / "configs/demo.yaml", [f"data.train={good}", "data.remote.retries=2",
                                                       "data.remote.backoff=0.01", "data.remote.timeout=2"])
        plan = build_data(cfg, load_sources(cfg), 1).plan
        assert len(plan.shards) == len(names)
        assert all(s.remote is cfg.data.remote and s.embeddings.remote is cfg.data.remote for s in plan.shards)
        urls.take_retries()
        with pytest.raises(OSError, match="after 2 retries"):
            list(read_tar(f"{proxy.url}/train/{names[0]}", remote=plan.shards[0].remote))
        assert urls.take_retries() == 2
    finally:
        proxy.close()


def test_a_shard_that_keeps_failing_is_unreadable_naming_url_and_cause(openmoji, http_server, fast_retries, caplog):
    name = sorted(json.loads((openmoji / "train/sizes.json").read_text()))[0]
    proxy = FaultProxy(http_server.port, "503", times=10**6)
    try:
        with caplog.at_level(logging.WARNING, logger="mmpretrain.data.urls"), pytest.raises(OSError) as err:
            list(read_tar(f"{proxy.url}/train/{name}", remote=fast_retries()))
        msg = str(err.value)
        assert f"{proxy.url}/train/{name}" in msg and "after 5 retries" in msg and "503" in msg
        assert urls.take_retries() == 5 and len([r for r in caplog.records if "retry" in r.message]) == 5
        # a missing object is not retried: it will not appear
        with pytest.raises(FileNotFoundError):
            list(read_tar(f"http://127.0.0.1:{http_server.port}/train/no-such-shard.tar", remote=fast_retries()))
        assert urls.take_retries() == 0
    finally:
        proxy.close()


def test_remote_settings_are_validated(tmp_path):
    cfg = load_config(None, ["data.train=x", "data.remote.retries=2", "data.remote.timeout=5"])
    assert cfg.data.remote.retries == 2 and cfg.data.remote.backoff == 1.0
    for bad in ("data.remote.retries=-1", "data.remote.timeout=0", "data.remote.retry=3"):
        with pytest.raises(ConfigError, match="remote"):
            load_config(None, ["data.train=x", bad])


IMG2DATASET = ROOT / ".cache/img2dataset/bin/img2dataset"  # `make img2dataset` (make test-slow)


@pytest.mark.slow
@pytest.mark.skipif(not IMG2DATASET.is_file(), reason="make img2dataset installs it (make test-slow)")
def test_cc3m_path_through_the_real_img2dataset(openmoji, tmp_path):
    """scripts/pretrain_cc3m.sh as a CC3M user runs it: a CC3M-format TSV (caption<TAB>url, no header) of
    real images (OpenMoji renders) served over loopback HTTP, one url dead; img2dataset itself
    downloads them into webdataset tars, then build (cut to --shard-size) -> verify -> embed -> train
    -> eval -> export."""
    import os
    import subprocess
    import sys
    www = tmp_path / "www"
    rows = extract_images(openmoji, 3, www)
    server = RangeHTTPServer(www)
    try:
        lines = [f"{caption}\thttp://127.0.0.1:{server.port}/{name}" for caption, name in rows]
        lines.append(f"a dead link\thttp://127.0.0.1:{server.port}/no-such-image.png")
        (tmp_path / "cc3m.tsv").write_text("\n".join(lines) + "\n")
        run, data = tmp_path / "run", tmp_path / "cc3m"
        r = subprocess.run(
            ["bash", str(ROOT / "scripts/pretrain_cc3m.sh"), "--tsv", str(tmp_path / "cc3m.tsv"), "--data", str(data),
             "--run", str(run), "--config", str(ROOT / "configs/tiny/soft_target.yaml"), "--accelerate-config", "none",
             "--image-size", "32", "--shard-size", "40", "--workers", "1", "--eval", str(openmoji), "--",
             "train.steps=3", "train.epochs=null", "data.batch_size=16", "data.num_workers=1", "data.shuffle_buffer=0",
             "optim.warmup_steps=1", "train.progress=false", "train.log_with=[]", "train.plots=false"],
            cwd=ROOT, capture_output=True, text=True, timeout=900,
            env={**os.environ, "PYTHON": sys.executable, "IMG2DATASET": str(IMG2DATASET)})
    finally:
        server.close()
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    raw = sorted((tmp_path / "cc3m_img2dataset").glob("*.tar"))
    assert raw, "img2dataset wrote no tars"
    stats = [json.loads(p.read_text()) for p in (tmp_path / "cc3m_img2dataset").glob("*_stats.json")]
    assert sum(s["successes"] for s in stats) == len(rows) and sum(s["count"] for s in stats) == len(rows) + 1
    sizes = json.loads((data / "sizes.json").read_text())
    assert sum(sizes.values()) == len(rows) and max(sizes.values()) <= 40 and len(sizes) >= len(rows) // 40
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["embedding"]["model"]
    log = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log if "loss" in x][-1] == 3
    assert json.loads((run / "results.json").read_text())["results"][0]["task"] == "zeroshot_classification"
    assert (run / "export/open_clip_model.safetensors").is_file()


def test_unreachable_stores_are_one_clear_error(fast_retries, monkeypatch):
    from mmpretrain.data.sources import resolve_sources

    with pytest.raises(ValueError, match="gcsfs"):  # the url's fsspec package is missing
        resolve_sources("gs://bucket/shard-{0..1}.tar", remote=fast_retries())
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    with pytest.raises(FileNotFoundError, match=r"cannot read .*sizes.json.*Connect.*endpoint_url"):
        resolve_sources(f"http://127.0.0.1:{port}/shard-{{0..1}}.tar", remote=fast_retries())
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    s3 = fast_retries(client_kwargs={"endpoint_url": f"http://127.0.0.1:{port}"})
    with pytest.raises(FileNotFoundError, match="NoCredentialsError"):  # not retried: the answer will not change
        resolve_sources("s3://bucket/shard-{0..1}.tar", remote=s3)
    assert urls.take_retries() == 0


def test_error_classification_reads_only_botocore_codes():
    class WithResponse(OSError):  # requests' and others' errors carry a response *object*
        response = object()

    class Boto(Exception):
        def __init__(self, code):
            super().__init__(code)
            self.response = {"Error": {"Code": code}}

    assert urls.retryable(WithResponse("reset"))
    assert not urls.retryable(Boto("NoSuchKey")) and not urls.retryable(Boto("AccessDenied"))
    assert urls.retryable(Boto("SlowDown"))
