"""Curation into keep-lists (python -m data_tools filter) and training on them (data.keep): each rule keeps
the keys a naive reference keeps, on real shards and stored teacher rows; the stream reads every kept
sample once an epoch and no other, resumes bit-identically; mistakes are one clear error."""

from __future__ import annotations

import hashlib
import io
import json
import re
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from data_tools import curate
from mmpretrain.data.keep import KEEP, POSITIONS
from mmpretrain.data.teacher import TEACHERS, teacher_files

from conftest import run_main, setup_run, train

QUICK = ["model.arch=mmpt-tiny-vit", "model.lock_text=false", "model.text_from_targets=false",
         "data.batch_size=16", "data.num_workers=0", "data.shuffle_buffer=32", "loss=[{name: clip}]"]


# --------------------------------------------------------------------------- the rules, against naive code

def _unit(x):
    x = np.asarray(x, dtype=np.float64)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_semdedup_equals_a_naive_pairwise_loop():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(120, 16))
    for i in range(0, 30, 3):  # planted near-copies
        x[60 + i] = x[i] + 0.01 * rng.normal(size=16)
    keep, labels = curate.semdedup(x, 0.98, 4, seed=0)
    u = _unit(x)
    cent = _unit(np.stack([u[labels == c].mean(0) for c in range(4)]))
    want = np.ones(len(x), dtype=bool)
    for c in range(4):
        members = [int(i) for i in np.flatnonzero(labels == c)]
        members.sort(key=lambda i: (float(u[i] @ cent[c]), i))  # least similar to the centroid first
        for j, b in enumerate(members):
            if any(float(u[a] @ u[b]) > 0.98 for a in members[:j]):
                want[b] = False
    assert (keep == want).all() and (~keep).sum() >= 10
    assert all(not (keep[i] and keep[60 + i]) for i in range(0, 30, 3))  # one of each planted pair goes


def test_score_balance_basic_and_near_any_equal_naive_code():
    rng = np.random.default_rng(1)
    s = rng.normal(size=50)
    assert set(np.flatnonzero(curate.score_mask(s, keep_top=0.3))) == set(np.argsort(-s)[:15])
    assert (curate.score_mask(s, min_score=0.2) == (s >= 0.2)).all()
    entries = [["a"] if i < 30 else ["b", "a"] if i < 35 else ["c"] if i < 45 else [] for i in range(50)]
    keys = [f"k{i}" for i in range(50)]
    keep, counts = curate.balance_mask(entries, keys, cap=10, seed=3)
    n = Counter(e for es in entries for e in es)

    def draw(key, e):
        h = hashlib.blake2b(f"3:{key}:{e}".encode(), digest_size=8).digest()
        return int.from_bytes(h, "little") / 2 ** 64

    want = [any(n[e] <= 10 or draw(k, e) < 10 / n[e] for e in es) for es, k in zip(entries, keys)]
    assert keep.tolist() == want and not keep[45:].any() and keep[35:45].all()
    assert 5 <= keep[:30].sum() <= 20  # "a" (35 samples) kept near its cap
    w, h = np.array([300, 199, 900, 250, -1]), np.array([300, 400, 250, 260, -1])
    caps = ["a red apple on a table", "a red apple on", "a red apple on a", "two words", "a red apple on a"]
    naive = [min(a, b) >= 200 and max(a, b) / min(a, b) < 3 and len(c.split()) > 2 and len(c) > 5
             for a, b, c in zip(w, h, caps)]
    assert curate.basic_mask(w, h, caps).tolist() == naive == [True, False, False, False, False]
    x, y = rng.normal(size=(30, 8)), rng.normal(size=(7, 8))
    np.testing.assert_allclose(curate.near_any(x, y), (_unit(x) @ _unit(y).T).max(1), atol=1e-5)
    assert curate.match_entries(["An ice cream cat in the category"], ["cat", "ice cream", "ice", "dog"]) == [
        ["cat", "ice", "ice cream"]]
    uid = "00ff" * 8
    arr = np.array([(int(uid[:16], 16), int(uid[16:], 16))], dtype="u8,u8")
    assert curate.uid_strings(arr) == {uid} == curate.uid_strings(np.array([uid.upper()]))


# --------------------------------------------------------------------------- the CLI on real shards

def _teacher_rows(data: Path):
    index = json.loads((data / TEACHERS).read_text())
    (tid, _), = index["teachers"].items()
    names = sorted(json.loads((data / "sizes.json").read_text()))
    keys = [k for n in names for k in (data / (n + ".teacher_keys.txt")).read_text().splitlines()]
    image = np.concatenate([np.load(data / (n + teacher_files(tid)[0]))[:, 0] for n in names]).astype(np.float64)
    text = np.concatenate([np.load(data / (n + teacher_files(tid)[1])) for n in names]).astype(np.float64)
    return names, keys, image, text


def _kept(out: Path) -> list[str]:
    index = json.loads((out / KEEP).read_text())
    return [k for n in sorted(index["shards"]) for k in (out / (n + ".keep.txt")).read_text().splitlines()]


def _filter(data: Path, out: Path, *rules: str):
    return run_main("data_tools", "filter", str(data), "--out", str(out), *rules)


def test_filter_score_dedup_and_balance_keep_the_naive_keys(teacher_data, tmp_path):
    data = teacher_data["data"]
    names, keys, image, text = _teacher_rows(data)
    score = (_unit(image) * _unit(text)).sum(1)
    r = _filter(data, tmp_path / "score", "--score", "teacher", "--keep-top", "0.4")
    assert r.returncode == 0, r.stderr[-2000:]
    want = set(np.array(keys)[np.argsort(-score, kind="stable")[:round(0.4 * len(keys))]])
    assert set(_kept(tmp_path / "score")) == want
    index = json.loads((tmp_path / "score" / KEEP).read_text())
    assert index["removed"] == {"score": len(keys) - len(want)} and index["total"] == len(keys)
    pos = np.load(tmp_path / "score" / (names[0] + POSITIONS))
    assert [keys[p] for p in pos] == (tmp_path / "score" / (names[0] + ".keep.txt")).read_text().splitlines()

    # composed: dedup (first in the fixed order), then the score cut on what dedup kept
    deduped, _ = curate.semdedup(image, 0.9, 3, seed=0)  # its pairwise pass is tested against naive code above
    srt = np.sort(score[deduped])
    cut = float(srt[-2] + srt[-3]) / 2  # between two survivors' scores (no tie at the boundary): 2 kept
    r = _filter(data, tmp_path / "both", "--score", "teacher", "--min-score", str(cut),
                "--dedup", "image", "--threshold", "0.9", "--clusters", "3")
    assert r.returncode == 0, r.stderr[-2000:]
    want = {keys[i] for i in np.flatnonzero(deduped) if score[i] >= cut}
    assert set(_kept(tmp_path / "both")) == want and 0 < (~deduped).sum() and len(want) < deduped.sum()
    rules = json.loads((tmp_path / "both" / KEEP).read_text())["rules"]
    assert [x["rule"] for x in rules] == ["dedup", "score"] and rules[1]["reached"] == deduped.sum()

    # SemDeDup on the caption model's rows (MiniLM, embed --model) and cluster balance on the teacher's
    minilm = np.concatenate([np.load(data / (n + ".emb.npy")) for n in names])
    r = _filter(data, tmp_path / "cap", "--dedup", "caption", "--threshold", "0.9", "--clusters", "4")
    assert r.returncode == 0, r.stderr[-2000:]
    deduped, _ = curate.semdedup(minilm, 0.9, 4, seed=0)
    assert set(_kept(tmp_path / "cap")) == set(np.array(keys)[deduped]) and (~deduped).sum() > 0
    r = _filter(data, tmp_path / "clu", "--balance", "cluster", "--clusters", "5", "--cap", "40")
    assert r.returncode == 0, r.stderr[-2000:]
    labels, _ = curate.kmeans(curate.unit(image), 5, 0)
    want_keep, counts = curate.balance_mask([[str(c)] for c in labels], keys, cap=40, seed=0)
    assert set(_kept(tmp_path / "clu")) == {k for k, w in zip(keys, want_keep) if w}
    for e, c in counts.items():  # a cluster under the cap is kept whole, one over it near the cap
        got = int(want_keep[labels == int(e)].sum())
        assert got == c if c <= 40 else 15 <= got <= 80, (c, got)
    assert max(counts.values()) > 40

    entries = tmp_path / "entries.txt"
    entries.write_text("face\nhand\nperson\nflag\n")
    r = _filter(data, tmp_path / "bal", "--balance", "entries", "--entries", str(entries), "--cap", "5", "--seed", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    from mmpretrain.data.tar import read_tar

    caps = [raw["txt"].decode() for n in names for raw in read_tar(data / n, only=("txt",))]
    matched = [sorted({e for e in ("face", "hand", "person", "flag") if re.search(rf"(?<!\w){e}(?!\w)", c.lower())})
               for c in caps]
    want_keep, _ = curate.balance_mask(matched, keys, cap=5, seed=2)
    assert set(_kept(tmp_path / "bal")) == {k for k, w in zip(keys, want_keep) if w}
    assert 0 < sum(want_keep) < sum(bool(m) for m in matched)


def test_decontaminate_removes_exactly_the_planted_copies(teacher_data, tmp_path):
    data = teacher_data["data"]
    names, keys, image, _ = _teacher_rows(data)
    ev = tmp_path / "eval"  # an evaluation set that leaked: two of the training shards
    ev.mkdir()
    sizes = json.loads((data / "sizes.json").read_text())
    for n in names[:2]:
        shutil.copy(data / n, ev / n)
    (ev / "sizes.json").write_text(json.dumps({n: sizes[n] for n in names[:2]}))
    r = _filter(data, tmp_path / "k", "--decontaminate", str(ev))
    assert r.returncode == 2 and "--augmentations 0" in r.stderr and "Traceback" not in r.stderr  # not embedded yet
    r = run_main("data_tools", "embed", str(ev), "--image-model", str(teacher_data["teacher"]), "--augmentations", "0")
    assert r.returncode == 0, r.stderr[-2000:]
    leaked = sizes[names[0]] + sizes[names[1]]
    near = (_unit(image) @ _unit(image[:leaked]).T).max(1)
    # the fixture's 3-step teacher puts every image within cosine 0.99 of another: a threshold between two
    # of the other images' values (a clear gap, no float32 tie) keeps some of them
    rest = np.sort(near[leaked:])
    k = next(i for i in range(10, len(rest) - 1) if rest[i + 1] - rest[i] > 1e-4)
    threshold = float(rest[k] + rest[k + 1]) / 2
    r = _filter(data, tmp_path / "k", "--decontaminate", str(ev), "--decontaminate-threshold", str(threshold))
    assert r.returncode == 0, r.stderr[-2000:]
    naive = near > threshold
    assert set(_kept(tmp_path / "k")) == set(np.array(keys)[~naive]) and naive[:leaked].all() and (~naive).sum() > 10


def _small_dataset(folder: Path, emoji_images) -> Path:
    """12 real emoji at several sizes with English, French and German captions and DataComp uids."""
    import webdataset as wds
    from PIL import Image

    folder.mkdir()
    caps = ["a grinning face with big eyes", "visage souriant aux grands yeux", "ein lachendes Gesicht mit Augen",
            "red apple", "a cat sitting on a mat", "a very small red heart shape"]
    sizes = [(300, 300), (640, 200), (150, 400), (256, 256), (400, 300), (199, 500)]
    with wds.TarWriter(str(folder / "s-000000.tar")) as w:
        for i in range(12):
            path, _ = emoji_images[i]
            img = Image.open(path).convert("RGB").resize(sizes[i % 6])
            buf = io.BytesIO()
            img.save(buf, "JPEG")
            w.write({"__key__": f"{i:04d}", "jpg": buf.getvalue(), "txt": caps[i % 6],
                     "json": json.dumps({"uid": f"{i:032x}", "subgroup": "face" if i < 9 else "heart"}).encode()})
    (folder / "sizes.json").write_text(json.dumps({"s-000000.tar": 12}))
    return folder


def test_basic_language_and_uid_rules_on_shards(emoji_images, tmp_path):
    import langid

    data = _small_dataset(tmp_path / "d", emoji_images)
    caps = ["a grinning face with big eyes", "visage souriant aux grands yeux", "ein lachendes Gesicht mit Augen",
            "red apple", "a cat sitting on a mat", "a very small red heart shape"]
    r = _filter(data, tmp_path / "basic", "--basic")
    assert r.returncode == 0, r.stderr[-2000:]
    assert _kept(tmp_path / "basic") == [f"{i:04d}" for i in range(12) if i % 6 in (0, 4)]  # sizes, aspect, words
    r = _filter(data, tmp_path / "en", "--language", "en")
    assert r.returncode == 0, r.stderr[-2000:]
    assert _kept(tmp_path / "en") == [f"{i:04d}" for i in range(12) if langid.classify(caps[i % 6])[0] == "en"]
    assert "0001" not in _kept(tmp_path / "en") and "0000" in _kept(tmp_path / "en")
    uids = tmp_path / "uids.npy"
    wanted = [3, 6, 10]
    np.save(uids, np.array([(0, i) for i in wanted], dtype="u8,u8"))
    r = _filter(data, tmp_path / "uid", "--uids", str(uids), "--basic")
    assert r.returncode == 0, r.stderr[-2000:]
    index = json.loads((tmp_path / "uid" / KEEP).read_text())
    assert _kept(tmp_path / "uid") == ["0006", "0010"] and index["removed"] == {"uids": 9, "basic": 1}
    r = _filter(data, tmp_path / "sub", "--balance", "subgroup", "--cap", "3", "--seed", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    groups = [["face"] if i < 9 else ["heart"] for i in range(12)]
    want, _ = curate.balance_mask(groups, [f"{i:04d}" for i in range(12)], cap=3, seed=1)
    assert _kept(tmp_path / "sub") == [f"{i:04d}" for i in range(12) if want[i]] and want[9:].all() and want[:9].sum() < 9
    r = run_main("data_tools", "stats", str(data), "--keep", str(tmp_path / "uid"))
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout)[0]["keep"]
    assert got["kept"] == 2 and got["removed"] == {"uids": 9, "basic": 1}


def test_filter_refuses_mistakes_and_keeps_user_files(teacher_data, emoji_images, tmp_path):
    data = teacher_data["data"]
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    for args, words in [((), "no rule"), (("--score", "teacher"), "--keep-top"), (("--keep-top", "0.5"), "--score"),
                        (("--balance", "cluster"), "--cap"), (("--uids", "missing.npy"), "no such file"),
                        (("--score", "teacher", "--keep-top", "1.5"), "fraction")]:
        r = _filter(data, out, *args)
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, (args, r.stderr[-500:])
    r = _filter(tmp_path / "nowhere", out, "--basic")
    assert r.returncode == 2 and "nowhere" in r.stderr and "Traceback" not in r.stderr
    r = _filter(_small_dataset(tmp_path / "d", emoji_images), out, "--score", "teacher", "--keep-top", "0.5")
    assert r.returncode == 2 and "--image-model" in r.stderr  # no teacher rows there
    assert _filter(data, out, "--score", "teacher", "--keep-top", "0.5").returncode == 0
    r = _filter(data, out, "--score", "teacher", "--keep-top", "0.5")
    assert r.returncode == 2 and "--overwrite" in r.stderr
    assert _filter(data, out, "--score", "teacher", "--keep-top", "0.2", "--overwrite").returncode == 0
    assert (out / "notes.txt").read_text() == "mine"
    index = json.loads((out / KEEP).read_text())
    index["files"].append("notes.txt")  # a record naming a user's file: only its shards' own names go
    (out / KEEP).write_text(json.dumps(index))
    assert _filter(data, out, "--score", "teacher", "--keep-top", "0.2", "--overwrite").returncode == 0
    assert (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in out.iterdir()) == sorted(["notes.txt", KEEP] + json.loads((out / KEEP).read_text())["files"])
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / KEEP).write_text("{}")
    r = _filter(data, theirs, "--basic")
    assert r.returncode == 2 and (theirs / KEEP).read_text() == "{}"


# --------------------------------------------------------------------------- training on a keep-list

@pytest.fixture(scope="module")
def kept(teacher_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("keep") / "list"
    r = _filter(teacher_data["data"], out, "--score", "teacher", "--keep-top", "0.6")
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def test_stream_reads_every_kept_sample_once_an_epoch_and_no_other(teacher_data, kept, tmp_path):
    from mmpretrain.data.plan import StreamPlan
    from mmpretrain.data.stream import TrainStream, make_loader

    data = teacher_data["data"]
    run = setup_run(data, tmp_path / "run", f"data.keep={kept}", "train.steps=2", *QUICK)
    base = run.loader.dataset.plan
    want = set(_kept(kept))
    all_keys = _teacher_rows(data)[1]
    assert base.num_samples == len(want) and sum(s.full_size for s in base.shards) == len(all_keys) > len(want)
    for R, W, B in [(1, 1, 8), (2, 2, 4), (4, 1, 5)]:
        plan = StreamPlan(base.sources, "epoch", 0, R, W, B, base.num_samples, 16)
        seen, dropped = [], 0
        for rank in range(R):
            it = iter(make_loader(TrainStream(plan, run.loader.dataset.decoder, rank), W))
            for _ in range(plan.steps_per_epoch):
                b = next(it)
                seen += b.keys
                dropped += b.skipped.get("dropped_remainder", 0)
                assert [all_keys[i] for i in b.sample_index.tolist()] == b.keys  # the shard's own index
        assert len(seen) == len(set(seen)) and set(seen) <= want
        assert len(want) - len(seen) == dropped == plan.dropped_per_epoch < R * B


def test_training_on_a_keep_list_resumes_bit_identically_and_records_it(teacher_data, kept, tmp_path):
    from safetensors.torch import load_file

    run_dir = tmp_path / "run"
    args = [f"data.keep={kept}", "train.steps=4", "train.save_every=2", "train.keep_last=5", *QUICK]
    r = train(teacher_data["data"], run_dir, *args)
    assert r.returncode == 0, r.stderr[-3000:]
    final = run_dir / "checkpoints/step_00000004"
    ref = load_file(next(final.glob("**/model.safetensors")))
    shutil.rmtree(final)
    r = train(teacher_data["data"], run_dir, *args)
    assert r.returncode == 0 and "resumed" in r.stderr, r.stderr[-3000:]
    got = load_file(next((run_dir / "checkpoints/step_00000004").glob("**/model.safetensors")))
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    record = json.loads((run_dir / "provenance.json").read_text())["data"][0]
    total = len(_teacher_rows(teacher_data["data"])[1])
    assert record["samples"] == len(_kept(kept)) and record["keep"]["list"] == str(kept) and record["keep"]["total"] == total
    # the same run without the list is another stream: its saved position is refused, not misread
    r = train(teacher_data["data"], run_dir, "train.steps=6", *QUICK)
    assert r.returncode == 2 and "data.keep" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_a_keep_list_that_does_not_fit_the_data_is_one_clear_error(teacher_data, kept, openmoji, tmp_path):
    data = teacher_data["data"]

    def refused(keep, *words, data=data):
        r = train(data, tmp_path / "run", f"data.keep={keep}", "train.steps=1", *QUICK)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert all(w in r.stderr for w in words), r.stderr[-2000:]

    refused(tmp_path / "missing", "not a folder")
    refused(openmoji / "test", "keep.json")
    refused(kept, "does not have", data=openmoji / "test")  # a list of other shards
    bad = tmp_path / "bad"
    shutil.copytree(kept, bad)
    index = json.loads((bad / KEEP).read_text())
    name = sorted(index["shards"])[0]
    pos = np.load(bad / (name + POSITIONS))
    np.save(bad / (name + POSITIONS), np.concatenate([pos[:-1], [10_000]]))
    refused(bad, name, "filter` again")
    np.save(bad / (name + POSITIONS), pos)
    index["shards"][name]["total"] += 1
    (bad / KEEP).write_text(json.dumps(index))
    refused(bad, name, "rebuilt")
    shutil.copytree(kept, tmp_path / "keys")
    for other in sorted(index["shards"])[1:]:  # the shards changed after filtering, all but one
        keys = tmp_path / "keys" / (other + ".keep.txt")
        keys.write_text("".join("x" + k + "\n" for k in keys.read_text().splitlines()))
    r = train(data, tmp_path / "run2", f"data.keep={tmp_path / 'keys'}", "train.steps=2", "train.log_every=1", *QUICK)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "keep_key_mismatch" in (tmp_path / "run2" / "log.jsonl").read_text()
