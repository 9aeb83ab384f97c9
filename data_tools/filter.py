"""``filter DATA --out LIST [rules]``: a keep-list (mmpretrain/data/keep.py) from rules that compose,
never touching a shard. The rules run in a fixed order, each on the samples the ones before it kept
(so ``--keep-top 0.3`` is 30 % of what reaches the score): ``uids``, ``basic``, ``language``,
``decontaminate``, ``dedup``, ``score``, ``balance``. The keep-list's ``keep.json`` records each rule's
settings, how many samples reached it and how many it removed. Inputs: the teachers' rows of ``embed
--image-model`` (score, image dedup, decontamination, cluster balance), the caption rows of ``embed
--model`` (caption dedup), the shards' json and captions (basic, language, UIDs, subgroup and entry
balance; read once, images only for the basic rule's sizes)."""

from __future__ import annotations

import io
import logging
import posixpath
import time
from pathlib import Path
from typing import Any

import numpy as np

from data_tools import curate
from mmpretrain.data.keep import FORMAT, KEEP, KEYS, POSITIONS, VERSION, digest, file_digest, write_shard
from mmpretrain.data.manifest import write_json_atomic
from mmpretrain.data.sidecar import SourceEmbeddings, load_npy, read_folder_json, read_index, shard_bytes
from mmpretrain.data.sources import resolve_source
from mmpretrain.data.tar import UNREADABLE, read_tar
from mmpretrain.data.teacher import SourceTeachers, read_teachers, teachers_problem

log = logging.getLogger("data_tools")
ORDER = ("uids", "basic", "language", "decontaminate", "dedup", "score", "balance")
IMAGES = ("jpg", "jpeg", "png", "webp")


class FilterError(RuntimeError):
    """A mistake the user can fix (exit 2), raised before anything is written."""


def _source(folder: str):
    if not Path(folder).is_dir():
        raise FilterError(f"{folder} is not a dataset folder (with the sizes.json that `python -m data_tools build` "
                          "writes)")
    splits = sorted(p.name for p in Path(folder).iterdir() if (p / "sizes.json").is_file())
    if splits and not (Path(folder) / "sizes.json").is_file():
        raise FilterError(f"{folder} holds split folders ({', '.join(splits)}): filter one, e.g. {Path(folder) / splits[0]}; "
                          "a keep-list is made for one dataset folder")
    try:
        return resolve_source(folder)
    except (FileNotFoundError, ValueError) as e:
        raise FilterError(str(e).replace("data.train: ", "")) from None


def _teacher(emb_dir: str, name: str | None, what: str) -> tuple[dict, str]:
    index = read_teachers(emb_dir)
    if index is None and (problem := teachers_problem(emb_dir)):
        raise FilterError(problem)
    if index is None or not index["teachers"]:
        raise FilterError(f"{what} needs a teacher's stored rows, and {emb_dir} holds no teachers.json: run `python -m "
                          f"data_tools embed {emb_dir} --image-model MODEL` (or give --embeddings, the folder it wrote)")
    tids = list(index["teachers"])
    if name is None:
        return index, tids[0]
    for tid in tids:
        if name in (tid, index["teachers"][tid].get("model")):
            return index, tid
    raise FilterError(f"--teacher {name}: {emb_dir}/teachers.json holds {[index['teachers'][t]['model'] for t in tids]}")


class Inputs:
    """Per-sample arrays of a dataset, over its shards in name order, loaded as the rules need them."""

    def __init__(self, data: str, embeddings: str | None, teacher: str | None):
        self.data, self.source = data, _source(data)
        self.emb_dir = embeddings or data
        self.teacher_name = teacher
        self.names = [posixpath.basename(u) for u in self.source.urls]
        self.sizes = self.source.sizes
        self.bounds = np.cumsum([0] + self.sizes)
        self.n = int(self.bounds[-1])
        self.keys: list[str] | None = None
        self.readable = np.ones(self.n, dtype=bool)
        self._teacher = self._captions = self._meta = None

    def _set_keys(self, keys: list[str], what: str) -> None:
        if self.keys is None:
            self.keys = keys
            return
        bad = next((i for i, (a, b) in enumerate(zip(self.keys, keys)) if a and b and a != b), None)
        if bad is not None:
            raise FilterError(f"{what}: sample {bad} has key {keys[bad]!r}, the shards {self.keys[bad]!r}: the rows "
                              "were made for other shards; embed again")

    def teacher(self) -> dict[str, np.ndarray]:
        """The stored teacher's ``image`` (n, E) evaluation-view rows, ``text`` (n, E) caption-0 rows and
        ``best`` (n,) the best caption's cosine (caption 0 and the extra captions)."""
        if self._teacher is None:
            index, tid = _teacher(self.emb_dir, self.teacher_name, "this rule")
            side = SourceTeachers(self.emb_dir, index, [tid])
            dim = int(index["teachers"][tid]["dim"])
            # filled shard by shard, each shard's arrays dropped after: the rows stay float16, held once
            image, text = np.empty((self.n, dim), np.float16), np.empty((self.n, dim), np.float16)
            extras, keys = [], []
            for k, (url, n) in enumerate(zip(self.source.urls, self.sizes)):
                rows = side.for_shard(url, n)
                if rows.reason:
                    raise FilterError(f"teacher rows of {posixpath.basename(url)}: {rows.reason}; run `python -m "
                                      f"data_tools embed {self.data} --image-model ...` again")
                a = int(self.bounds[k])
                image[a:a + n], text[a:a + n] = rows.images[0][:, 0], rows.texts[0]
                extras.append((rows.extras[0] if len(rows.extras[0]) else None, rows.offsets))
                keys += rows.keys
                del rows
            self._set_keys(keys, "teacher rows")
            self._teacher = {"image": image, "text": text, "extras": extras, "model": index["teachers"][tid]["model"],
                             "tid": tid, "finite": curate.finite_rows(image) & curate.finite_rows(text)}
        return self._teacher

    def captions(self) -> np.ndarray:
        """The caption model's rows of caption 0 (embed --model)."""
        if self._captions is None:
            index = read_index(self.emb_dir)
            if index is None:
                raise FilterError(f"--dedup caption needs caption rows, and {self.emb_dir} holds no embeddings.json: run "
                                  f"`python -m data_tools embed {self.data} --model MODEL` first")
            side, rows, keys = SourceEmbeddings(self.emb_dir, index), [], []
            for url, n in zip(self.source.urls, self.sizes):
                shard = side.for_shard(url, n)
                if shard.rows is None:
                    raise FilterError(f"caption rows of {posixpath.basename(url)}: {shard.reason}; embed again")
                rows.append(shard.rows)
                keys += shard.keys
            self._set_keys(keys, "caption rows")
            self._captions = np.concatenate(rows)
        return self._captions

    def meta(self, sizes: bool) -> dict[str, Any]:
        """From the shards: ``caption`` (the .txt), ``json`` (dict), and with ``sizes`` the image's
        ``width``/``height`` (img2dataset's original_width/original_height in the json where present, else the
        stored image's header; -1 when unreadable)."""
        if self._meta is None or (sizes and "width" not in self._meta):
            only = ("json", "txt") + (IMAGES if sizes else ())
            keys, caps, jsons, w, h = [""] * self.n, [""] * self.n, [{}] * self.n, np.full(self.n, -1), np.full(self.n, -1)
            for k, url in enumerate(self.source.urls):
                i = int(self.bounds[k])
                try:
                    for raw in read_tar(url, only=only):
                        if i >= self.bounds[k + 1]:
                            break
                        self._sample(raw, i, keys, caps, jsons, w, h, sizes)
                        i += 1
                except UNREADABLE as e:
                    log.warning("%s unreadable after sample %d (%s): its other samples are removed as unreadable",
                                url, i - int(self.bounds[k]), e)
                if i < self.bounds[k + 1]:
                    self.readable[i:int(self.bounds[k + 1])] = False
            self._set_keys(keys, "the shards")
            self._meta = {"caption": caps, "json": jsons} | ({"width": w, "height": h} if sizes else {})
        return self._meta

    @staticmethod
    def _sample(raw, i, keys, caps, jsons, w, h, sizes) -> None:
        import json

        from PIL import Image

        keys[i] = raw["__key__"]
        caps[i] = raw.get("txt", b"").decode("utf-8", "replace").strip()
        try:
            jsons[i] = json.loads(raw["json"]) if "json" in raw else {}
        except ValueError:
            jsons[i] = {}
        if not sizes:
            return
        j = jsons[i] if isinstance(jsons[i], dict) else {}
        if isinstance(j.get("original_width"), int) and isinstance(j.get("original_height"), int):
            w[i], h[i] = j["original_width"], j["original_height"]
            return
        data = next((raw[e] for e in IMAGES if e in raw), None)
        try:
            w[i], h[i] = Image.open(io.BytesIO(data)).size
        except Exception:  # no image, or not one: the basic rule removes it
            pass

    def all_keys(self) -> list[str]:
        if self.keys is None:
            self.meta(sizes=False)
        return self.keys


def _best_caption(t: dict[str, Any]) -> np.ndarray:
    """Each sample's best cosine over caption 0 and its extra captions (the teacher's text rows)."""
    best = curate.cosines(t["image"], t["text"])
    start = 0
    for rows, offsets in t["extras"]:
        counts = np.diff(offsets)
        for i in np.flatnonzero(counts):
            im = curate.unit(t["image"][start + i:start + i + 1])
            best[start + i] = max(best[start + i], float((curate.unit(rows[offsets[i]:offsets[i + 1]]) @ im.T).max()))
        start += len(counts)
    return best


def _decontam_rows(eval_dirs: list[str], tid: str, model: str) -> np.ndarray:
    rows = []
    for d in eval_dirs:
        src = _source(d)
        index = read_teachers(d)
        if index is None and (problem := teachers_problem(d)):
            raise FilterError(f"--decontaminate {d}: {problem}")
        if index is None or tid not in index["teachers"]:
            raise FilterError(f"--decontaminate {d}: it holds no rows of the teacher {model}; embed it with the same "
                              f"teacher: `python -m data_tools embed {d} --image-model {model} --augmentations 0`")
        side = SourceTeachers(d, index, [tid])
        for url, n in zip(src.urls, src.sizes):
            shard = side.for_shard(url, n)
            if shard.reason:
                raise FilterError(f"--decontaminate {d}: {posixpath.basename(url)}: {shard.reason}; embed it again")
            rows.append(shard.images[0][:, 0])
    rows = np.concatenate(rows)
    return rows[curate.finite_rows(rows)]  # a NaN row is near nothing (it would remove every training image)


def _read_uids(path: str) -> set[str]:
    """``--uids``: a DataComp UID list, checked before any work (FilterError naming the flag and the file)."""
    try:
        return curate.uid_strings(load_npy(str(path)))
    except ValueError as e:
        raise FilterError(f"--uids {path}: {str(e).replace(str(path) + ' ', '', 1)}; give DataComp's .npy UID list "
                          "(structured u8,u8, (n, 2) integers, or hex strings)") from None


def _read_entries(path: str) -> list[str]:
    """``--entries``: one metadata entry a line, UTF-8 text."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise FilterError(f"--entries {path} is not UTF-8 text (byte {e.start}); give one entry a line, UTF-8") from None
    except OSError as e:
        raise FilterError(f"--entries {path} cannot be read ({e.__class__.__name__}: {e})") from None
    if not any(line.strip() for line in lines):
        raise FilterError(f"--entries {path} holds no entry; give one entry a line")
    return lines


def _rows(x: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """The rows ``idx`` of ``x`` (``x`` itself, not a copy, when they are all of it)."""
    return x if len(idx) == len(x) else x[idx]


def _unusable(name: str, inp: Inputs, opts: dict[str, Any]) -> np.ndarray | None:
    """The samples whose stored rows rule ``name`` reads hold a NaN or an infinity (None: it reads none)."""
    if name in ("decontaminate", "score") or (name, opts.get("dedup")) == ("dedup", "image") or \
            (name, opts.get("balance")) == ("balance", "cluster"):
        return ~inp.teacher()["finite"]
    if name == "dedup":
        return ~curate.finite_rows(inp.captions())
    return None


def _rule(name: str, inp: Inputs, alive: np.ndarray, opts: dict[str, Any]) -> tuple[np.ndarray, dict[str, Any]]:
    """The mask over the ``alive`` samples of rule ``name`` and the settings it records."""
    idx = np.flatnonzero(alive)
    if name == "uids":
        wanted = opts["uid_set"]
        meta = inp.meta(sizes=False)
        uids = [str((j if isinstance(j, dict) else {}).get("uid") or k).lower()
                for j, k in zip(meta["json"], inp.all_keys())]
        return np.array([uids[i] in wanted for i in idx], dtype=bool), {"file": str(opts["uids"]), "listed": len(wanted),
                                                                          "matched_on": "json uid, else the key"}
    if name == "basic":
        meta = inp.meta(sizes=True)
        caps = [meta["caption"][i] for i in idx]
        return curate.basic_mask(meta["width"][idx], meta["height"][idx], caps), {
            "min_side": 200, "max_aspect": 3.0, "min_words": 3, "min_chars": 6}
    if name == "language":
        caps = inp.meta(sizes=False)["caption"]
        return curate.language_mask([caps[i] for i in idx], opts["language"]), {"lang": opts["language"],
                                                                                "detector": "langid"}
    if name == "decontaminate":
        t = inp.teacher()
        others = _decontam_rows(opts["decontaminate"], t["tid"], t["model"])
        near = curate.near_any(_rows(t["image"], idx), others)
        return near <= opts["decontaminate_threshold"], {"eval": opts["decontaminate"], "eval_images": len(others),
                                                        "threshold": opts["decontaminate_threshold"], "teacher": t["model"]}
    if name == "dedup":
        what = opts["dedup"]
        x = inp.teacher()["image"] if what == "image" else inp.captions()
        k = opts["clusters"] or curate.default_clusters(len(idx))
        keep, _ = curate.semdedup(_rows(x, idx), opts["threshold"], k, opts["seed"])
        return keep, {"on": what, "rows": "teacher evaluation view" if what == "image" else "caption model, caption 0",
                      "threshold": opts["threshold"], "clusters": k, "kmeans": curate.kmeans_backend(),
                      "survivor": "farthest from its centroid"}
    if name == "score":
        t = inp.teacher()
        scores = _best_caption(t) if opts["score_caption"] == "best" else curate.cosines(t["image"], t["text"])
        s = scores[idx]
        keep = curate.score_mask(s, opts["keep_top"], opts["min_score"])
        return keep, {"teacher": t["model"], "caption": opts["score_caption"], "keep_top": opts["keep_top"],
                      "min_score": opts["min_score"], "threshold": float(s[keep].min()) if keep.any() else None}
    if name == "balance":
        by = opts["balance"]
        keys = inp.all_keys()
        if by == "cluster":
            k = opts["clusters"] or curate.default_clusters(len(idx))
            labels, _ = curate.kmeans(curate.unit(_rows(inp.teacher()["image"], idx)), k, opts["seed"])
            entries = [[str(c)] for c in labels]
        elif by == "subgroup":
            js = inp.meta(sizes=False)["json"]
            entries = [[str(js[i]["subgroup"])] if isinstance(js[i], dict) and js[i].get("subgroup") else [] for i in idx]
        else:
            caps = inp.meta(sizes=False)["caption"]
            lines = opts["entry_lines"]
            entries = curate.match_entries([caps[i] for i in idx], lines)
        keep, counts = curate.balance_mask(entries, [keys[i] for i in idx], opts["cap"], opts["seed"])
        return keep, {"by": by, "cap": opts["cap"], "entries": len(counts), "over_cap": sum(c > opts["cap"] for c in counts.values()),
                      **({"clusters": k, "kmeans": curate.kmeans_backend()} if by == "cluster" else {}), **({"file": opts["entries"]} if by == "entries" else {})}
    raise AssertionError(name)


def filter_dataset(data: str, out: str | None = None, *, overwrite: bool = False, embeddings: str | None = None,
                   teacher: str | None = None, **opts: Any) -> dict[str, Any]:
    """Apply the rules ``opts`` names (see :data:`ORDER`) and write the keep-list; returns its keep.json."""
    start = time.time()
    out_dir = Path(out) if out else Path(data) / "keep"
    if out_dir.exists() and not out_dir.is_dir():
        raise FilterError(f"--out {out_dir} is a file; give a folder for the keep-list")
    old = read_folder_json(str(out_dir), KEEP) if out_dir.is_dir() else None
    if (out_dir / KEEP).exists() and not (isinstance(old, dict) and old.get("format") == FORMAT):
        raise FilterError(f"{out_dir / KEEP} exists and is not a keep-list this tool wrote: give another --out")
    if old is not None and not overwrite:
        raise FilterError(f"{out_dir} already holds a keep-list ({old.get('kept')} of {old.get('total')} kept): give "
                          "--overwrite to replace it, or another --out")
    rules = [r for r in ORDER if opts.get(r)]
    if not rules:
        raise FilterError("no rule given: add --score teacher, --dedup, --balance, --basic, --language, --decontaminate "
                          "or --uids")
    if opts.get("uids"):
        opts["uid_set"] = _read_uids(opts["uids"])
    if opts.get("entries"):
        opts["entry_lines"] = _read_entries(opts["entries"])
    inp = Inputs(data, embeddings, teacher)
    # the filter's manifest: a file of --out is replaced or deleted only while its bytes are the ones the
    # earlier list recorded writing (its "digests"), whatever else keep.json names
    recorded = (old or {}).get("digests") if isinstance((old or {}).get("digests"), dict) else {}
    ours = {f for f, sha in recorded.items() if isinstance(f, str) and "/" not in f and f not in (KEEP, "")
            and file_digest(out_dir / f) == sha}
    names = [n + suffix for n in inp.names for suffix in (POSITIONS, KEYS)]
    foreign = [f for f in names if (out_dir / f).exists() and f not in ours]
    if foreign:
        raise FilterError(f"--out {out_dir} holds {foreign[0]} ({len(foreign)} file(s)) that no earlier filter wrote "
                          "there (or that changed since): the keep-list would replace it. Move it away or give "
                          "another --out")
    alive = np.ones(inp.n, dtype=bool)
    record, removed = [], {}
    for name in rules:
        bad = _unusable(name, inp, opts)
        if bad is not None and (bad & alive).any():
            n = int((bad & alive).sum())
            removed["nonfinite_rows"] = removed.get("nonfinite_rows", 0) + n
            alive &= ~bad
            log.warning("%d sample(s) have NaN or infinite stored rows: removed before the %s rule (counted as "
                        "nonfinite_rows); embed their shards again", n, name)
        reached = int(alive.sum())
        keep, settings = _rule(name, inp, alive, opts)
        idx = np.flatnonzero(alive)
        alive[idx[~keep]] = False
        removed[name] = reached - int(alive.sum())
        record.append({"rule": name, **settings, "reached": reached, "removed": removed[name]})
        log.info("%s: %d of %d removed", name, removed[name], reached)
    if (~inp.readable & alive).any():
        removed["unreadable"] = int((~inp.readable & alive).sum())
        alive &= inp.readable
    if not alive.any():
        said = ", ".join(f"{r}: {n}" for r, n in removed.items())
        raise FilterError(f"the rules keep no sample of {inp.n} (removed by {said}): nothing written; loosen them")
    keys = inp.all_keys()
    out_dir.mkdir(parents=True, exist_ok=True)
    shards, digests = {}, {}
    for k, (url, name) in enumerate(zip(inp.source.urls, inp.names)):
        a, b = int(inp.bounds[k]), int(inp.bounds[k + 1])
        pos = np.flatnonzero(alive[a:b])
        digests.update(write_shard(out_dir, name, pos, [keys[a + p] for p in pos]))
        shards[name] = {"total": b - a, "kept": int(len(pos)), "bytes": shard_bytes(url),
                        "first_key": keys[a] if b > a else None, "digest": digest(pos)}
    index = {"format": FORMAT, "version": VERSION, "data": str(Path(data).resolve()), "rules": record,
             "removed": removed, "total": inp.n, "kept": int(alive.sum()), "seed": opts.get("seed", 0),
             "seconds": round(time.time() - start, 1), "shards": shards, "files": sorted(digests),
             "digests": digests}
    write_json_atomic(out_dir / KEEP, index, allow_nan=False)
    for f in ours - set(digests):  # the earlier list's own files this one does not rewrite
        (out_dir / f).unlink(missing_ok=True)
    return index
