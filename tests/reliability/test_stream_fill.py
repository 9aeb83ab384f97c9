"""One bad shard never stops a run while good data remains: 4 real shards, one of them an HTML error page
(an unreadable shard) or with a damaged caption-embedding sidecar, at the geometries where readers
outnumber good shards (1 rank x 2 and 4 workers, 2 ranks x 2 workers). A reader whose share lies in the
bad shard fills its batches from the epoch's good data by a rule a resume replays; the run stops only when
no decodable sample is left anywhere, naming every bad shard."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from mmpretrain.data.decode import SampleDecoder
from mmpretrain.data.plan import StreamPlan
from mmpretrain.data.reader import Reader, StreamError
from mmpretrain.data.sidecar import attach_embeddings
from mmpretrain.data.sources import resolve_sources

from conftest import BAD_SHARD_RUN, CONFIG, HTML_PAGE, damaged, run_main

BAD = 2  # the damaged shard of the 4 (conftest.damaged)


def _decoder():
    from open_clip.transform import PreprocessCfg, image_transform_v2

    return SampleDecoder(image_transform_v2(PreprocessCfg(size=32), is_train=True), embeddings="require")


def _plan(spec: str, ranks: int, workers: int, batch: int = 20) -> StreamPlan:
    """The demo config's stream (shuffle blocks of 500) over the 4 shards: 200 samples, batches of 20, so
    no spare sample (as the demo's 400 in batches of 16, where it stopped)."""
    sources = resolve_sources(spec)
    attach_embeddings(sources, None)
    total = sum(s.num_samples for s in sources)
    return StreamPlan(sources, "epoch", 0, ranks, workers, batch, total, 500)


def _read(plan: StreamPlan, rank: int, worker: int, cursor=(0, 0, 0, 0), decoder=None):
    """(sample indices, cursors after each, skipped) of one reader's epoch from ``cursor``."""
    skipped, out, cursors = Counter(), [], []
    for item, after in Reader(plan, decoder or _decoder(), rank, worker).epoch(list(cursor), skipped):
        out.append(item["index"])
        cursors.append(after)
    return out, cursors, skipped


@pytest.mark.parametrize("kind", ["html", "sidecar"])
@pytest.mark.parametrize("ranks, workers", [(1, 2), (1, 4), (2, 2)])
def test_every_reader_fills_its_share_from_good_data(openmoji, tmp_path, kind, ranks, workers):
    plan = _plan(damaged(openmoji, tmp_path / "d", kind), ranks, workers)
    sizes = [s.size for s in plan.shards]
    bad = set(range(plan.shards[BAD].offset, plan.shards[BAD].offset + sizes[BAD]))
    good = set(range(sum(sizes))) - bad
    seen, skipped = Counter(), Counter()
    for rank in range(ranks):
        for w in range(workers):
            idx, _, sk = _read(plan, rank, w)
            assert len(idx) == plan.reader_length(0, w)  # every reader makes its whole share
            seen.update(idx)
            skipped += sk
    assert not set(seen) & bad and set(seen) <= good
    reason = "unreadable_shard" if kind == "html" else "missing_embedding"
    assert skipped[reason] == sizes[BAD]  # each bad sample counted once, by the reader whose range holds it
    filled = skipped["repeated_to_fill"] + skipped["borrowed_to_fill"]
    assert sum(seen.values()) == ranks * plan.steps * plan.batch_size
    # every good sample of the main ranges is seen; fills repeat good ones, counted
    assert sum(c - 1 for c in seen.values()) == filled
    if workers * ranks == 4:  # a reader's whole range lies in the bad shard: it had to borrow
        assert skipped["borrowed_to_fill"] > 0


@pytest.mark.parametrize("kind", ["html", "sidecar"])
def test_a_filling_reader_resumes_bit_identically(openmoji, tmp_path, kind):
    """Resumed from any cursor of a reader that fills (its share inside the bad shard), the rest of its
    epoch is the uninterrupted run's."""
    plan = _plan(damaged(openmoji, tmp_path / "d", kind), 1, 4)
    decoder = _decoder()
    victim = next(w for w in range(4) if _read(plan, 0, w, decoder=decoder)[2]["borrowed_to_fill"])
    full, cursors, _ = _read(plan, 0, victim, decoder=decoder)
    for cut in (1, len(full) // 2, len(full) - 1):
        rest, _, _ = _read(plan, 0, victim, cursors[cut - 1], decoder)
        assert rest == full[cut:], cut


def test_no_decodable_sample_anywhere_names_every_bad_shard(openmoji, tmp_path):
    """Two shards HTML, two with damaged sidecars: nothing is usable, the stream stops in one line naming
    all four and why."""
    spec = damaged(openmoji, tmp_path / "d", "html")
    names = sorted(p.name for p in (tmp_path / "d").glob("*.tar"))[:4]
    (tmp_path / "d" / names[0]).write_bytes(HTML_PAGE)
    for name in names[1], names[3]:
        (tmp_path / "d" / f"{name}.emb.npy").write_bytes(b"\x93NUMPY garbage")
    plan = _plan(spec, 1, 2)
    with pytest.raises(StreamError) as e:
        _read(plan, 0, 1)
    line = str(e.value)
    assert "no decodable sample left in epoch 0" in line and "data_tools verify" in line
    unreadable, skipping = line.split("unreadable shard(s): ")[1].split("; shard(s) whose samples were all skipped: ")
    assert names[0] in unreadable and names[2] in unreadable
    assert names[1] in skipping and names[3] in skipping and "missing_embedding" in skipping


@pytest.mark.parametrize("kind, workers", [("html", 2), ("html", 4), ("sidecar", 2), ("sidecar", 4)])
def test_the_cli_trains_its_epoch_with_the_bad_shard_counted(openmoji, tmp_path, kind, workers):
    """Through the trainer: one epoch of 200 samples (10 steps of 20), the bad shard's 50 counted once, no
    traceback (it stopped mid-epoch: a reader whose range starts in the bad shard gave up)."""
    spec = damaged(openmoji, tmp_path / "d", kind)
    r = run_main("mmpretrain.train", "--config", str(CONFIG), f"data.train={spec}",
                 f"run_dir={tmp_path / 'run'}", *BAD_SHARD_RUN, f"data.num_workers={workers}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    last = json.loads((tmp_path / "run" / "log.jsonl").read_text().splitlines()[-1])
    reason = "unreadable_shard" if kind == "html" else "missing_embedding"
    assert last["step"] == 10 and last["skipped"][reason] == 50, last


@pytest.mark.parametrize("kind", ["html", "sidecar"])
def test_two_ranks_of_two_workers_train_their_epoch(ddp_checks, kind):
    """The same epoch under accelerate launch, 2 ranks x 2 workers (tests/scripts/ddp_checks.py): 5 steps
    of 2 x 20, the bad shard's 50 counted once over both ranks."""
    got = ddp_checks["runs"][f"bad_{kind}"]
    assert got["exit"] == 0, got
    reason = "unreadable_shard" if kind == "html" else "missing_embedding"
    assert got["last"]["step"] == 5 and got["last"]["skipped"][reason] == 50, got
