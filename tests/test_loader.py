"""The training stream on real shards (OpenMoji, built and embedded by the public commands), with 2
ranks x 2 DataLoader workers: exact epochs, bit-identical resume, bad samples counted, source
weights, pipe: urls."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from collections import Counter
from pathlib import Path

import pytest
import torch
from data_copies import in_tar_copy

from mmpretrain.data.decode import SampleDecoder
from mmpretrain.data.plan import StreamPlan
from mmpretrain.data.sidecar import attach_embeddings
from mmpretrain.data.sources import resolve_sources
from mmpretrain.data.stream import StreamPosition, TrainStream, make_loader

R, W, B = 2, 2, 8


def _decoder(embeddings="require"):
    from open_clip.transform import PreprocessCfg, image_transform_v2

    # the training transform has random crops: resume must reproduce them bit for bit
    return SampleDecoder(image_transform_v2(PreprocessCfg(size=32), is_train=True), embeddings=embeddings,
                         draft_size=32)


def _plan(spec, mode="epoch", weights=None, num_samples=None, block=16, seed=0, remote=None):
    sources = resolve_sources(str(spec), weights, remote)
    attach_embeddings(sources, None)  # as the trainer does: sidecar embeddings beside the shards
    return StreamPlan(sources, mode, seed, R, W, B, num_samples or sum(s.num_samples for s in sources), block)


def _batches(plan, rank, n, start=None, decoder=None, tokenizer=None):
    loader = make_loader(TrainStream(plan, decoder or _decoder(), rank, tokenizer=tokenizer, start=start), W)
    it = iter(loader)
    out = [next(it) for _ in range(n)]
    del it, loader
    return out


def _epoch_keys(plan, decoder=None):
    keys, skipped = [], Counter()
    for rank in range(R):
        for b in _batches(plan, rank, plan.steps_per_epoch, decoder=decoder):
            assert b.epoch == 0
            keys += b.keys
            skipped.update(b.skipped)
    return keys, skipped


def _all_keys(folder: Path) -> list[str]:
    keys = []
    for shard in sorted(folder.glob("*.tar")):
        with tarfile.open(shard) as t:
            keys += list(dict.fromkeys(m.name.split(".", 1)[0] for m in t.getmembers()))
    return keys


def test_one_epoch_is_every_sample_once_minus_the_stated_remainder(openmoji):
    plan = _plan(openmoji / "train")
    everything = _all_keys(openmoji / "train")
    assert plan.num_samples == len(everything) > R * W * B
    keys, skipped = _epoch_keys(plan)
    assert len(keys) == len(set(keys)) == R * plan.steps_per_epoch * B  # nothing twice
    assert set(keys) <= set(everything)
    assert skipped == {"dropped_remainder": len(everything) - len(keys)} and plan.dropped_per_epoch < R * B
    # the next epoch is a different order of the same samples
    nxt = [k for rank in range(R) for b in _batches(plan, rank, 2 * plan.steps_per_epoch)[plan.steps_per_epoch:]
           for k in b.keys]
    assert len(set(nxt)) == len(nxt) and nxt != keys


def _same(a, b):
    assert a.keys == b.keys
    assert torch.equal(a.images, b.images)
    assert torch.equal(a.target_embeddings, b.target_embeddings)
    assert a.cursor == b.cursor and a.worker == b.worker
    assert (a.tokens is None) == (b.tokens is None) and (a.tokens is None or torch.equal(a.tokens, b.tokens))


def test_resume_at_five_positions_is_bit_identical(openmoji):
    plan = _plan(openmoji / "train")
    spe = plan.steps_per_epoch
    stops = [1, 6, spe - 1, spe, spe + 3]  # mid-block, end of an epoch, first batch of the next, ...
    assert len(set(stops)) == 5
    from open_clip import tokenize

    for rank in range(R):
        full = _batches(plan, rank, max(stops) + 3, tokenizer=tokenize)
        assert full[0].tokens.shape == (B, 77)
        pos = StreamPosition(plan)
        for n, b in enumerate(full, 1):
            pos.advance(b)
            if n in stops:
                state = json.loads(json.dumps(pos.state()))  # through JSON, as in the checkpoint
                resumed = _batches(plan, rank, 3, start=StreamPosition(plan, state).state(), tokenizer=tokenize)
                for a, c in zip(full[n:n + 3], resumed):
                    _same(a, c)


def test_resume_refuses_a_different_layout(openmoji):
    plan = _plan(openmoji / "train")
    state = StreamPosition(plan).state()
    other = StreamPlan(plan.sources, "epoch", 0, R, W, 2 * B, plan.num_samples, 16)
    with pytest.raises(ValueError, match="batch_size: saved 8, now 16"):
        StreamPosition(other, state)


def test_uneven_worker_shares_keep_epochs_whole_and_resume_exact(openmoji):
    """A batch size that gives an odd number of steps an epoch on 2 ranks, so worker 0 makes one batch
    more of epoch 0 than worker 1, and epoch 1 opens on worker 1. The DataLoader's round robin still
    gives the rank its epochs whole and in order, every sample once but the remainder (< one global
    batch), and resume across the boundary is bit-identical."""
    base = _plan(openmoji / "train")
    B = next(b for b in range(7, 40) if (base.num_samples // (R * b)) % W == 1)
    plan = StreamPlan(base.sources, "epoch", 0, R, W, B, base.num_samples, 16)
    S = plan.steps_per_epoch
    assert S % W == 1 and plan.worker_batches(0, 0) == plan.worker_batches(0, 1) + 1 and plan.first_worker(1) == 1
    keys, skipped = [], Counter()
    for rank in range(R):
        run = _batches(plan, rank, 2 * S + 2)
        assert [b.epoch for b in run] == [0] * S + [1] * S + [2] * 2
        assert [b.worker for b in run] == [n % W for n in range(2 * S + 2)]
        for b in run[:S]:
            keys += b.keys
            skipped.update(b.skipped)
        pos = StreamPosition(plan)
        for n, b in enumerate(run, 1):
            pos.advance(b)
            if n in (S - 1, S, S + 1):
                assert pos.epoch == (n >= S)
                state = json.loads(json.dumps(pos.state()))
                for a, c in zip(run[n:n + 2], _batches(plan, rank, 2, start=state)):
                    _same(a, c)
    assert len(keys) == len(set(keys)) == R * S * B
    assert skipped == {"dropped_remainder": plan.num_samples - len(keys)} and plan.dropped_per_epoch < R * B


def test_a_position_of_the_old_layout_is_refused(openmoji):
    """Positions saved before the reader layout changed (no 'layout' in their plan) are refused with the
    fix, not resumed onto other samples."""
    plan = _plan(openmoji / "train")
    state = StreamPosition(plan).state()
    del state["plan"]["layout"]
    with pytest.raises(ValueError, match="layout: saved None, now 2.*model.pretrained=CHECKPOINT"):
        StreamPosition(plan, state)


def _rewrite(shard: Path, change: dict[str, dict[str, bytes | None]]) -> None:
    """Replace (bytes) or drop (None) members ``key -> {suffix: value}`` of a shard."""
    with tarfile.open(shard) as t:
        members = [(m.name, t.extractfile(m).read()) for m in t.getmembers() if m.isfile()]
    with tarfile.open(shard, "w") as out:
        for name, data in members:
            key, suffix = name.split(".", 1)
            if key in change and suffix in change[key]:
                data = change[key][suffix]
                if data is None:
                    continue
            info = tarfile.TarInfo(name)
            info.size = len(data)
            out.addfile(info, io.BytesIO(data))


def test_bad_samples_are_skipped_counted_and_replaced_from_spares(openmoji, tmp_path):
    data = in_tar_copy(openmoji / "train", tmp_path / "train")  # rewritten shards: sidecars would not match
    plan = _plan(data)
    assert plan.dropped_per_epoch // (R * W) >= 1  # every reader has a spare
    # one bad sample inside each reader's range (where the sample is, is known from the layout alone),
    # two in the last reader's: it has one spare, so one of its own samples is repeated to fill
    kinds = [("png", b"not an image", "undecodable_image"), ("emb.npy", None, "missing_embedding"),
             ("txt", b"   ", "empty_caption"), ("txt", b"\xff\xfe", "caption_not_utf8"),
             ("png", None, "missing_image")]
    changes: dict[str, dict] = {}
    bad: dict[str, str] = {}
    for reader in range(R * W):
        main, _ = plan.reader_layout(0, reader)
        seg = main[0]
        shard = Path(plan.urls[seg.shard])
        with tarfile.open(shard) as t:  # sample i of a shard is the i-th key in tar order
            keys = list(dict.fromkeys(m.name.split(".", 1)[0] for m in t.getmembers()))[seg.start:seg.stop]
        for j, (suffix, value, reason) in enumerate(kinds[reader:reader + (2 if reader == R * W - 1 else 1)]):
            changes.setdefault(shard.name, {})[keys[j]] = {suffix: value}
            bad[keys[j]] = reason
    for name, change in changes.items():
        _rewrite(data / name, change)
    keys, skipped = _epoch_keys(plan)
    expected = Counter(bad.values())
    assert {k: v for k, v in skipped.items() if k in expected} == expected
    assert skipped["repeated_to_fill"] == 1
    assert not set(keys) & set(bad)
    assert len(keys) == R * plan.steps_per_epoch * B and len(set(keys)) == len(keys) - 1
    good = set(_all_keys(data)) - set(bad)
    # every good sample is seen once, except the part of the remainder no reader's spares took:
    # each reader used its one spare for its bad sample
    assert len(good) - len(set(keys)) == skipped["dropped_remainder"] - R * W >= 0


def test_truncated_shard_counts_its_lost_samples(openmoji, tmp_path):
    data = in_tar_copy(openmoji / "train", tmp_path / "train")
    plan = _plan(data, block=0)
    main, _ = plan.reader_layout(0, 0)
    shard = Path(plan.urls[main[0].shard])
    raw = shard.read_bytes()
    shard.write_bytes(raw[: len(raw) // 2])
    keys, skipped = _epoch_keys(plan)
    lost = skipped["missing_in_shard"] + skipped["unreadable_shard"]
    assert lost > 0
    assert len(keys) == R * plan.steps_per_epoch * B
    assert len(set(keys)) + skipped["repeated_to_fill"] == len(keys)


def test_resampled_mode_follows_source_weights(openmoji):
    train = openmoji / "train"
    names = sorted(json.loads((train / "sizes.json").read_text()))
    a = str(train / "openmoji-train-{000000..000003}.tar")
    b = str(train / f"openmoji-train-{{000004..{len(names) - 1:06d}}}.tar")
    plan = _plan(f"{a}::{b}", mode="resampled", weights=[1, 3], num_samples=300)
    draws = Counter()
    for reader in range(R * W):
        gen = plan.drawn_segments(0, reader)
        for _ in range(2500):
            draws[plan.urls[next(gen).shard] in plan.sources[1].urls] += 1
    share = draws[True] / sum(draws.values())
    assert abs(share - 0.75) < 0.02  # 10,000 draws: standard error 0.004
    # the stream runs on it, with the stated budget per epoch
    assert plan.steps_per_epoch == 300 // (R * B)
    keys = [k for b_ in _batches(plan, 0, plan.steps_per_epoch + 1) for k in b_.keys]
    assert len(keys) == (plan.steps_per_epoch + 1) * B


def test_pipe_urls_read_the_same_stream(openmoji):
    train = openmoji / "train"
    names = sorted(json.loads((train / "sizes.json").read_text()))
    spec = "pipe:cat " + str(train / f"openmoji-train-{{000000..{len(names) - 1:06d}}}.tar")
    direct, piped = _plan(train), _plan(spec)
    assert [s.size for s in piped.shards] == [s.size for s in direct.shards]
    a = _batches(direct, 1, 4)
    b = _batches(piped, 1, 4)
    for x, y in zip(a, b):
        _same(x, y)


def test_sources_without_counts_are_refused(tmp_path, openmoji):
    shutil.copy(next((openmoji / "train").glob("*.tar")), tmp_path / "a.tar")
    with pytest.raises(FileNotFoundError, match="sizes.json"):
        resolve_sources(str(tmp_path / "a.tar"))
    with pytest.raises(ValueError, match="one weight per"):
        resolve_sources(str(openmoji / "train"), [1, 2])


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
@pytest.mark.parametrize("gz", [False, True])
def test_tar_reader_agrees_with_webdatasets(tmp_path, fmt, gz):
    from webdataset.tariterators import tarfile_samples

    from mmpretrain.data.tar import read_tar

    def iter_samples(path):  # webdataset's own reader: the anchor
        return tarfile_samples(iter([{"url": str(path)}]))

    path = tmp_path / ("s.tar.gz" if gz else "s.tar")
    deep = "d" * 60 + "/" + "e" * 40 if fmt == tarfile.USTAR_FORMAT else "d" * 120  # long names need GNU/pax
    with tarfile.open(path, "w:gz" if gz else "w", format=fmt) as t:
        for i in range(5):
            for ext, data in (("jpg", bytes([i]) * (700 + i)), ("txt", f"caption é {i}".encode())):
                info = tarfile.TarInfo(f"{deep}/k{i}.{ext}")
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
    ref = [{k: v for k, v in s.items() if not k.startswith("__") or k == "__key__"} for s in iter_samples(path)]
    assert len(ref) == 5
    assert list(read_tar(str(path))) == ref
    assert list(read_tar(str(path), skip=3)) == ref[3:]


def test_uint8_batches_normalised_on_the_device_equal_the_float_ones(openmoji):
    """The trainer's loader ends its augmentation in PILToTensor (uint8: a quarter of the shared-memory
    and host-to-device bytes) and normalises on the device: bit for bit the float transform's batch,
    random crops included."""
    from open_clip.transform import PreprocessCfg, image_transform_v2

    from mmpretrain.data.decode import split_normalize

    full = image_transform_v2(PreprocessCfg(size=32), is_train=True)
    uint8, normalize = split_normalize(full)
    plan = _plan(openmoji / "train")
    floats = _batches(plan, 1, 3, decoder=SampleDecoder(full, embeddings="require", draft_size=32))
    small = _batches(plan, 1, 3, decoder=SampleDecoder(uint8, embeddings="require", draft_size=32))
    for f, u in zip(floats, small):
        assert u.images.dtype == torch.uint8 and f.images.dtype == torch.float32
        assert u.images.nbytes * 4 == f.images.nbytes
        assert u.keys == f.keys
        assert torch.equal(normalize(u.images), f.images)
    assert split_normalize(lambda im: im)[1] is None  # any other transform is kept whole
