"""``python -m data_tools negatives DIR --out OUT``: rule-based hard-negative captions, with no parser.

Each sample's caption 0 (its ``txt``) gets negatives written as ``negative_captions`` in its ``json``
(kept apart from the positive ``captions``), made by two rules of the kind SugarCrepe's swap and replace
splits test:

- ``swap``: two different content words of the caption exchange places ("a cat on a mat" -> "a mat on
  a cat");
- ``replace``: one content word becomes a content word of another caption of the dataset that this
  caption does not hold ("a cat on a mat" -> "a dog on a mat").

A content word is alphabetic, at least 3 letters and not in a short English stop list. Each draw is
seeded by (seed, rule, sample key) alone, so a rerun writes the same negatives. A caption with fewer than
two different content words has no swap; one with none has no replace: it gets fewer negatives (counted
in the manifest's ``negatives`` record, with the rules, seed and source). Every other member of every
sample is copied as it is; OUT has the same shard names and ``sizes.json``. Caption embeddings are not
copied: the shards change size, so run ``data_tools embed OUT`` again when training needs them.

``--layout sugar_crepe`` writes an evaluation set instead: SugarCrepe's layout (``val2017/{key}.jpg`` and
one ``{split}.json`` per rule, ``{id: {filename, caption, negative_caption}}``) from a held-out split, so
``python -m mmpretrain.eval --task image_caption_selection`` (and clip_benchmark) score a model on the
rules' negatives. clip_benchmark takes only SugarCrepe's seven split names, so ``swap`` is written as
``swap_obj.json`` and ``replace`` as ``replace_obj.json``: rule-made stand-ins, not SugarCrepe's data.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from pathlib import Path
from typing import Any

from data_tools.build import check_source_and_out
from data_tools.writers import BuildError, recorded_files
from mmpretrain.data.manifest import MANIFEST, SIZES, read_manifest, read_sizes, write_json_atomic
from mmpretrain.data.tar import UNREADABLE, read_tar

RULES = ("swap", "replace")
STOP = frozenset("""a an the and or but nor of with without in on at to for from by as into onto over under
above below near off out up down than then this that these those there here its his her their our your my
is are was were be been being has have had does did not no yes very some any each every all both few many
much more most other such only own same too can will just one two three four five six seven eight nine ten
who whom whose which what when where why how it he she they we you them him us""".split())
WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)?")


def content_words(caption: str) -> list[re.Match]:
    return [m for m in WORD.finditer(caption) if len(m.group()) >= 3 and m.group().lower() not in STOP
            and "'" not in m.group()]


def _rng(seed: int, rule: str, key: str) -> random.Random:
    h = hashlib.blake2b(f"{seed}:{rule}:{key}".encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(h, "little"))


def swap(caption: str, rng: random.Random) -> str | None:
    words = content_words(caption)
    pairs = [(a, b) for i, a in enumerate(words) for b in words[i + 1:] if a.group().lower() != b.group().lower()]
    if not pairs:
        return None
    a, b = rng.choice(pairs)
    return caption[:a.start()] + b.group() + caption[a.end():b.start()] + a.group() + caption[b.end():]


def replace(caption: str, rng: random.Random, vocabulary: list[str]) -> str | None:
    words = content_words(caption)
    own = {w.group().lower() for w in words}
    if not words:
        return None
    target = rng.choice(words)
    # drawn by position in the sorted vocabulary until one is not in this caption (a few tries suffice
    # on any real vocabulary; a caption holding every word gets none)
    for _ in range(32):
        word = vocabulary[rng.randrange(len(vocabulary))] if vocabulary else None
        if word is None:
            return None
        if word not in own:
            return caption[:target.start()] + word + caption[target.end():]
    return None


def make_negatives(caption: str, key: str, rules: tuple[str, ...], seed: int, vocabulary: list[str],
                   positives: set[str]) -> list[str]:
    """The negatives of one caption, one per rule that applies, none equal to a positive caption."""
    out: list[str] = []
    for rule in rules:
        rng = _rng(seed, rule, key)
        neg = swap(caption, rng) if rule == "swap" else replace(caption, rng, vocabulary)
        if neg is not None and neg.strip().lower() not in positives and neg not in out:
            out.append(neg)
    return out


def _captions(raw: dict[str, Any]) -> tuple[str | None, dict | None]:
    """Caption 0 and the parsed json ({} when absent, None when unreadable or not an object)."""
    caption = None
    if "txt" in raw:
        try:
            caption = raw["txt"].decode("utf-8").strip() or None
        except UnicodeDecodeError:
            caption = None
    meta: Any = {}
    if "json" in raw:
        try:
            meta = json.loads(raw["json"])
        except (ValueError, UnicodeDecodeError):
            meta = None
    return caption, meta if isinstance(meta, dict) else None


def _check_out(src: Path, out: Path, overwrite: bool) -> None:
    """OUT may hold only what an earlier run of this command (or a build) wrote: a finished dataset is
    replaced with --overwrite only; an interrupted run (its manifest lists the shards it was writing, no
    sizes.json yet) is cleared and redone; a tar nothing here wrote is refused. Nothing else is removed."""
    check_source_and_out(str(src), out)
    if not out.exists():
        return
    if not out.is_dir():
        raise BuildError(f"--out {out} is a file: choose a folder")
    ours = recorded_files(out)
    try:
        record = read_manifest(out).get("negatives")
    except (ValueError, AttributeError):
        record = None
    if isinstance(record, dict) and isinstance(record.get("shards"), list):
        names = [n for n in record["shards"] if isinstance(n, str) and "/" not in n]
        ours |= {f for n in names for f in (out / n, out / (n + ".tmp")) if f.is_file()} | {out / MANIFEST}
    foreign = sorted(p for p in out.glob("*.tar") if p not in ours)
    if foreign:
        raise BuildError(f"--out {out} holds {foreign[0]} ({len(foreign)} tar file(s)) that no data_tools command "
                         "wrote: choose an empty folder")
    if (out / SIZES).is_file() and not overwrite:
        raise BuildError(f"--out {out} already holds a dataset ({out / SIZES}); pass --overwrite to replace it")
    pending = isinstance(record, dict) and record.get("pending") is True
    if ours and not (overwrite or pending):  # e.g. a manifest.json of the user's, with no run of ours behind it
        raise BuildError(f"--out {out} holds {sorted(ours)[0].name}, which no interrupted run of this command left: "
                         "pass --overwrite to replace it, or choose another --out")
    for f in sorted(ours):  # only what an earlier command wrote (its sizes.json's shards, manifest, sizes)
        f.unlink(missing_ok=True)


def negatives(source: str | Path, out: str | Path, *, rules: tuple[str, ...] = RULES, seed: int = 0,
              overwrite: bool = False) -> dict[str, Any]:
    """Write OUT: SOURCE's shards with ``negative_captions`` in each sample's json. Returns the summary."""
    src, out = Path(source), Path(out)
    bad = [r for r in rules if r not in RULES]
    if bad or not rules:
        raise BuildError(f"--rules {' '.join(rules)}: choose from {', '.join(RULES)}")
    if not (src / SIZES).is_file():
        raise BuildError(f"{src}: not a dataset folder (no {SIZES}); build one with `python -m data_tools build`")
    try:
        sizes = read_sizes(src)
    except ValueError as e:
        raise BuildError(str(e)) from None
    _check_out(src, out, overwrite)
    shards = [src / name for name in sorted(sizes)]
    missing = [p for p in shards if not p.is_file()]
    if missing:
        raise BuildError(f"{src}: {len(missing)} shard(s) in {SIZES} are missing (first: {missing[0]})")
    vocab: set[str] = set()
    try:
        for shard in shards:  # pass 1: the dataset's content words (every caption, positives included)
            for raw in read_tar(shard):
                caption, meta = _captions(raw)
                texts = [caption or ""] + [c for c in (meta or {}).get("captions", []) if isinstance(c, str)]
                vocab |= {m.group().lower() for t in texts for m in content_words(t)}
    except UNREADABLE as e:
        raise BuildError(f"{src}: a shard is not a readable tar ({e}); run data_tools verify") from None
    vocabulary = sorted(vocab)
    out.mkdir(parents=True, exist_ok=True)
    # written first: an interrupted run's shards are then known as this command's (cleared by the rerun)
    write_json_atomic(out / MANIFEST, {"negatives": {"source": str(src), "pending": True, "shards": sorted(sizes)}})
    import webdataset as wds

    counts = {"samples": 0, "negatives": 0, "without_negatives": 0, "without_caption": 0, "unreadable_json": 0}
    written: dict[str, int] = {}
    for shard in shards:
        tmp = out / (shard.name + ".tmp")
        n = 0
        with wds.TarWriter(str(tmp), encoder=False) as w:
            for raw in read_tar(shard):
                caption, meta = _captions(raw)
                sample = {k: v for k, v in raw.items() if not k.startswith("__") or k == "__key__"}
                n += 1
                counts["samples"] += 1
                if caption is None or meta is None:  # copied as it is, counted
                    counts["without_caption" if caption is None else "unreadable_json"] += 1
                    w.write(sample)
                    continue
                meta = dict(meta)
                positives = {caption.lower()} | {c.strip().lower() for c in meta.get("captions", []) if isinstance(c, str)}
                negs = make_negatives(caption, raw["__key__"], rules, seed, vocabulary, positives)
                meta.pop("negative_captions", None)
                if negs:
                    meta["negative_captions"] = negs
                counts["negatives"] += len(negs)
                counts["without_negatives"] += not negs
                sample["json"] = json.dumps(meta, ensure_ascii=False).encode()
                w.write(sample)
        tmp.replace(out / shard.name)
        written[shard.name] = n
    record = {"rules": list(rules), "seed": seed, "source": str(src), **counts, "shards": sorted(written)}
    manifest = dict(read_manifest(src), negatives=record)
    write_json_atomic(out / MANIFEST, manifest)
    write_json_atomic(out / SIZES, written)
    return {"out": str(out), **{k: v for k, v in record.items() if k != "shards"}}


LAYOUT_SPLITS = {"swap": "swap_obj", "replace": "replace_obj"}


def sugar_crepe_layout(source: str | Path, out: str | Path, *, rules: tuple[str, ...] = RULES, seed: int = 0,
                       overwrite: bool = False) -> dict[str, Any]:
    """SOURCE's images and captions in SugarCrepe's layout at OUT, one negative per sample and rule.
    Writes only ``val2017/`` and the split files; refuses an OUT holding anything else."""
    from PIL import Image

    src, out = Path(source), Path(out)
    if not (src / SIZES).is_file():
        raise BuildError(f"{src}: not a dataset folder (no {SIZES}); build one with `python -m data_tools build`")
    check_source_and_out(str(src), out)
    ours = {out / f"{s}.json" for s in LAYOUT_SPLITS.values()} | {out / "val2017"}
    if out.exists():
        others = [p for p in out.iterdir() if p not in ours]
        if others:
            raise BuildError(f"--out {out} holds {others[0].name} (not this layout's): choose an empty folder")
        if any(p.exists() for p in ours) and not overwrite:
            raise BuildError(f"--out {out} already holds a SugarCrepe layout; pass --overwrite to replace it")
    samples = []
    for name in sorted(read_sizes(src)):
        for raw in read_tar(src / name):
            caption, meta = _captions(raw)
            ext = next((e for e in ("jpg", "jpeg", "png", "webp") if e in raw), None)
            if caption and ext:
                samples.append((raw["__key__"], raw[ext], caption, meta or {}))
    vocabulary = sorted({m.group().lower() for _, _, c, _ in samples for m in content_words(c)})
    images = out / "val2017"
    images.mkdir(parents=True, exist_ok=True)
    counts = {}
    for rule in rules:
        entries = {}
        for key, _, caption, meta in samples:
            positives = {caption.lower()} | {c.strip().lower() for c in meta.get("captions", []) if isinstance(c, str)}
            negs = make_negatives(caption, key, (rule,), seed, vocabulary, positives)
            if negs:
                entries[str(len(entries))] = {"filename": f"{key}.jpg", "caption": caption, "negative_caption": negs[0]}
        write_json_atomic(out / f"{LAYOUT_SPLITS[rule]}.json", entries)
        counts[LAYOUT_SPLITS[rule]] = len(entries)
    for key, data, _, _ in samples:  # COCO's layout holds JPEGs: converted once, at quality 95
        import io

        with Image.open(io.BytesIO(data)) as im:
            im.convert("RGB").save(images / f"{key}.jpg", quality=95)
    return {"out": str(out), "layout": "sugar_crepe", "rules": list(rules), "seed": seed, "source": str(src),
            "images": len(samples), "instances": counts}


__all__ = ["LAYOUT_SPLITS", "sugar_crepe_layout", "RULES", "content_words", "make_negatives", "negatives", "replace", "swap"]
