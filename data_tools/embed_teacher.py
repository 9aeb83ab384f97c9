"""``embed SHARDS --image-model M [--augmentations K] [--out EMB_DIR]``: a CLIP teacher's image
embeddings of each image's evaluation view and of K training crops, the crops' parameters, and the
teacher's text embeddings of every caption, stored beside the shards
(:mod:`mmpretrain.data.teacher` owns the layout). No tar is written.

The crops are drawn by the training crop sampler (:class:`~mmpretrain.data.crop.CropSampler`, the
distribution of torchvision's ``RandomResizedCrop``), seeded by ``(--seed, key)``, so every teacher of
an ensemble -- embedded now or later -- sees the same crops, and training replays them. Resumable
(``EMB_DIR/.embed/NAME.tar.teacher-TID.json`` per shard and teacher) and split across ranks under
``accelerate launch`` (each rank every world-th shard; rank 0 writes ``teachers.json``). Images are
decoded and cropped by a thread pool while the teacher runs on the previous batch.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from data_tools.embed import MARKERS, EmbedError, _extra_captions, _fingerprint, embed_jobs
from mmpretrain.data.crop import CropSampler, ResizedCrop
from mmpretrain.data.decode import IMAGE_EXTS, augmentation_seed
from mmpretrain.data.manifest import write_json_atomic
from mmpretrain.data.tar import UNREADABLE, read_tar
from mmpretrain.data.teacher import (
    COUNTS,
    CROPS,
    KEYS,
    TEACHER_VERSION,
    TEACHERS,
    read_teachers,
    save_npy,
    teacher_files,
    teacher_id,
    teachers_problem,
)
from mmpretrain.data.urls import shard_path
from mmpretrain.process import current_process

SAMPLER = "torchvision RandomResizedCrop.get_params distribution (mmpretrain.data.crop.CropSampler)"
INTERPOLATIONS = {"bicubic": Image.BICUBIC, "bilinear": Image.BILINEAR, "nearest": Image.NEAREST,
                  "lanczos": Image.LANCZOS, "box": Image.BOX}


class Teacher:
    """An open_clip model as a teacher: its evaluation transform, its training-crop transform (the
    crop resized to its input with its interpolation, then its normalisation) and both encoders."""

    def __init__(self, spec: str, pretrained: str | None, device: str):
        import open_clip
        from torchvision import transforms as T

        from mmpretrain.models.from_disk import load_model

        arch = spec in open_clip.list_models() and not Path(spec).exists()
        if arch and not pretrained:
            raise EmbedError(f"--image-model {spec} is an open_clip architecture: give --pretrained TAG (e.g. "
                             f"{', '.join(open_clip.list_pretrained_tags_by_model(spec)[:3]) or 'a tag'}); an "
                             "untrained teacher would teach nothing")
        if pretrained and not arch:
            raise EmbedError(f"--pretrained {pretrained} goes with an open_clip architecture name; --image-model "
                             f"{spec} names its own weights (a folder or hf-hub:)")
        try:
            self.model, self.preprocess, self.tokenizer = load_model(spec, device, pretrained)
        except (FileNotFoundError, ValueError, RuntimeError, OSError) as e:
            raise EmbedError(f"--image-model {spec}: {e}") from None
        if not hasattr(self.model, "encode_text") or not hasattr(self.model, "encode_image"):
            raise EmbedError(f"--image-model {spec}: not a CLIP model with image and text towers")
        self.spec, self.pretrained, self.device = spec, pretrained, device
        self.id = teacher_id(spec, pretrained)
        steps = list(getattr(self.preprocess, "transforms", []))
        norm = next((s for s in steps if isinstance(s, T.Normalize)), None)
        size = getattr(self.model.visual, "image_size", None)
        if norm is None or size is None:
            raise EmbedError(f"--image-model {spec}: its preprocessing has no Normalize step or no input size")
        self.size = (size, size) if isinstance(size, int) else tuple(int(s) for s in size)
        resize = next((s for s in steps if hasattr(s, "interpolation")), None)
        self.interpolation = getattr(getattr(resize, "interpolation", None), "value", "bicubic")
        self.crop = ResizedCrop(self.size, interpolation=INTERPOLATIONS.get(self.interpolation, Image.BICUBIC),
                                draft=False)
        self.mean = torch.tensor(norm.mean, dtype=torch.float32).reshape(3, 1, 1)
        self.std = torch.tensor(norm.std, dtype=torch.float32).reshape(3, 1, 1)
        # the evaluation transform up to its to-tensor + Normalize, on PIL (uint8, normalised batch-wise
        # like the crops: the same operations as ToTensor and Normalize); else the whole transform per image
        tail = [type(x).__name__ for x in steps[-2:]]
        self.eval_pil = T.Compose(steps[:-2]) if tail in (["ToTensor", "Normalize"], ["MaybeToTensor", "Normalize"]) \
            else None
        with torch.no_grad():
            self.dim = int(self.image(torch.zeros(1, 3, *self.size)).shape[1])
        self.weights = weights_digest(self.model)

    def same_as(self, block: dict) -> bool:
        """Whether a teacher ``teachers.json`` records is this one: the same weights (by their digest), or
        for a record without one, the same folder or name and tag."""
        if block.get("weights"):
            return block["weights"] == self.weights
        same = block.get("model") == self.spec or (Path(self.spec).exists() and Path(str(block.get("model"))).exists()
                                                   and Path(self.spec).resolve() == Path(block["model"]).resolve())
        return same and block.get("pretrained") == self.pretrained

    def record(self) -> dict:
        scale = getattr(self.model, "logit_scale", None)  # its own (learned) scale: distill's teacher_scale option
        return {"model": self.spec, "pretrained": self.pretrained, "weights": self.weights, "dim": self.dim,
                "image_size": list(self.size),
                "logit_scale": round(float(scale.detach().exp()), 4) if isinstance(scale, torch.Tensor) else None,
                "interpolation": self.interpolation, "mean": self.mean.flatten().tolist(),
                "std": self.std.flatten().tolist(), "eval_view": "the model's evaluation transform (index 0)",
                "crop_views": "crop (original pixels) resized to image_size, normalised (indices 1..K)"}

    def uint8_views(self, img: Image.Image, boxes) -> torch.Tensor | None:
        """``(1 + K, H, W, 3)`` uint8: the evaluation view, then each box's crop (None when the evaluation
        transform is not PIL steps + to-tensor + Normalize)."""
        if self.eval_pil is None:
            return None
        first = np.asarray(self.eval_pil(img))
        if first.shape != (*self.size, 3):
            return None
        out = np.empty((1 + len(boxes), *self.size, 3), dtype=np.uint8)
        out[0] = first
        size = (self.size[1], self.size[0])  # Pillow's (width, height)
        for j, (top, left, h, w) in enumerate(boxes):  # Pillow's resize of the box: no intermediate crop image
            out[1 + j] = np.asarray(img.resize(size, self.crop.interpolation, box=(left, top, left + w, top + h)))
        return torch.from_numpy(out)

    def normalize(self, u8: torch.Tensor) -> torch.Tensor:
        """uint8 ``(N, H, W, 3)`` views -> the teacher's input ``(N, 3, H, W)``, in one pass over the batch."""
        return u8.permute(0, 3, 1, 2).float().div_(255).sub_(self.mean).div_(self.std)

    def views(self, img: Image.Image, boxes) -> torch.Tensor:
        """``(1 + K, 3, H, W)``: the evaluation view, then each box's crop."""
        u8 = self.uint8_views(img, boxes)
        if u8 is not None:
            return self.normalize(u8)
        crops = self.normalize(torch.stack([self.crop.resize(img, box, 1) for box in boxes])) if boxes else None
        first = self.preprocess(img)[None]
        return first if crops is None else torch.cat([first, crops])

    @torch.no_grad()
    def image(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.normalize(self.model.encode_image(x.to(self.device)).float(), dim=-1).cpu()

    @torch.no_grad()
    def text(self, captions: list[str], batch_size: int) -> torch.Tensor:
        out = [torch.nn.functional.normalize(self.model.encode_text(self.tokenizer(captions[i:i + batch_size])
                                                                    .to(self.device)).float(), dim=-1).cpu()
               for i in range(0, len(captions), batch_size)]
        return torch.cat(out) if out else torch.zeros(0, self.dim)


def _sample(raw: dict, sampler: CropSampler, k: int, seed: int):
    """``(image or None, crops (1 + K, 4), caption or None, extra captions)`` of one raw sample."""
    key = raw["__key__"]
    crops = np.full((1 + k, 4), -1, dtype=np.int32)
    img = None
    ext = next((e for e in IMAGE_EXTS if e in raw), None)
    if ext is not None:
        try:
            img = Image.open(io.BytesIO(raw[ext]))
            img.load()
            img = img.convert("RGB")
        except Exception:  # undecodable: the stream skips it before reading its rows
            img = None
    if img is not None:
        rng = random.Random(augmentation_seed(seed, 0, key + "/teacher-crops"))
        crops[0] = (0, 0, img.height, img.width)
        for j in range(k):
            crops[1 + j] = tuple(sampler(img.width, img.height, rng))
    try:
        caption = raw["txt"].decode("utf-8").strip() if "txt" in raw else None
    except UnicodeDecodeError:
        caption = None
    return img, crops, caption or None, _extra_captions(raw.get("json"))


def embed_shard(teacher: Teacher, url: str, expected: int, emb_dir: Path, aug: dict, batch_size: int,
                pool: ThreadPoolExecutor) -> int:
    """One shard's files for ``teacher``; returns its image count."""
    try:
        raws = list(read_tar(url, only=(*IMAGE_EXTS, "txt", "json")))
    except UNREADABLE as e:
        raise EmbedError(f"{url}: unreadable ({e.__class__.__name__}: {e}); run `data_tools verify` and rebuild it") \
            from None
    if len(raws) != expected:
        raise EmbedError(f"{url}: {len(raws)} samples, sizes.json says {expected}; run `data_tools verify`")
    k, sampler = aug["count"], CropSampler(aug["scale"], aug["ratio"])
    samples = list(pool.map(lambda r: _sample(r, sampler, k, aug["seed"]), raws))
    n, e = len(samples), teacher.dim
    image_rows = np.full((n, 1 + k, e), np.nan, dtype=np.float16)
    # views of a batch's images made by the pool while the teacher runs on the previous batch
    per = max(1, batch_size // (1 + k))
    todo = [i for i, s in enumerate(samples) if s[0] is not None]
    chunks = [todo[i:i + per] for i in range(0, len(todo), per)]

    def make(chunk):  # uint8 views stacked, then normalised once for the chunk
        boxes = [[tuple(b) for b in samples[i][1][1:]] for i in chunk]
        u8 = [teacher.uint8_views(samples[i][0], b) for i, b in zip(chunk, boxes)]
        if any(u is None for u in u8):
            return torch.cat([teacher.views(samples[i][0], b) for i, b in zip(chunk, boxes)])
        return teacher.normalize(torch.cat(u8))

    pending = pool.submit(make, chunks[0]) if chunks else None
    for c, chunk in enumerate(chunks):
        views = pending.result()
        if c + 1 < len(chunks):
            pending = pool.submit(make, chunks[c + 1])
        image_rows[chunk] = teacher.image(views).reshape(len(chunk), 1 + k, e).numpy().astype(np.float16)
    captions = [s[2] for s in samples]
    text_rows = np.full((n, e), np.nan, dtype=np.float16)
    have = [i for i, c in enumerate(captions) if c is not None]
    text_rows[have] = teacher.text([captions[i] for i in have], batch_size).numpy().astype(np.float16)
    extra = [c for s in samples for c in s[3]]
    extra_rows = teacher.text(extra, batch_size).numpy().astype(np.float16)
    name = os.path.basename(shard_path(url))
    keys = [r["__key__"] for r in raws]
    tmp = emb_dir / (name + KEYS + ".tmp")
    tmp.write_text("".join(x + "\n" for x in keys))
    os.replace(tmp, emb_dir / (name + KEYS))
    save_npy(emb_dir / (name + CROPS), np.stack([s[1] for s in samples]))
    save_npy(emb_dir / (name + COUNTS), np.array([len(s[3]) for s in samples], dtype=np.int64))
    for suffix, rows in zip(teacher_files(teacher.id), (image_rows, text_rows, extra_rows)):
        save_npy(emb_dir / (name + suffix), rows)
    write_json_atomic(_marker(emb_dir, name, teacher.id), {
        **_signature(teacher, aug), "count": n, "first_key": keys[0] if keys else None, "extra": len(extra),
        "undecodable": n - len(todo), **_fingerprint(url)})
    return len(todo)


def _marker(emb_dir: Path, name: str, tid: str) -> Path:
    return emb_dir / MARKERS / f"{name}.teacher-{tid}.json"


def _signature(teacher: Teacher, aug: dict) -> dict:
    return {"model": teacher.spec, "pretrained": teacher.pretrained, "augmentations": aug}


def _done(emb_dir: Path, url: str, teacher: Teacher, aug: dict) -> dict | None:
    name = os.path.basename(shard_path(url))
    try:
        done = json.loads(_marker(emb_dir, name, teacher.id).read_text())
    except (OSError, ValueError):
        return None
    fresh = {k: done.get(k) for k in ("model", "pretrained", "augmentations", "bytes", "mtime_ns")} == {
        **_signature(teacher, aug), **_fingerprint(url)}
    files = all((emb_dir / (name + s)).is_file() for s in (KEYS, CROPS, COUNTS, *teacher_files(teacher.id)))
    return done if fresh and files else None


def embed_teachers(path: str | Path, models: list[str], *, pretrained: str | None = None,
                   augmentations: int | None = None,
                   out: str | Path | None = None, overwrite: bool = False, batch_size: int = 256,
                   device: str | None = None, seed: int = 0, scale=(0.9, 1.0), ratio=(3 / 4, 4 / 3),
                   workers: int = 2) -> list[dict]:
    """Embed every dataset ``path`` names with each teacher of ``models`` (an ensemble shares the crops).
    ``augmentations`` None: the K recorded in the first dataset's ``teachers.json``, else 10."""
    jobs = embed_jobs(str(path), out)
    if augmentations is None:
        recorded = (read_teachers(str(jobs[0][1])) or {}).get("augmentations") or {}
        augmentations = int(recorded.get("count", 10))
    if augmentations < 0:
        raise EmbedError(f"--augmentations {augmentations}: give 0 or more training crops per image")
    try:
        CropSampler(scale, ratio)
    except ValueError as e:
        raise EmbedError(f"--crop-scale / --crop-ratio: {e}") from None
    aug = {"count": int(augmentations), "seed": int(seed), "scale": [float(s) for s in scale],
           "ratio": [float(r) for r in ratio], "sampler": SAMPLER}
    for _, emb_dir, _ in jobs:  # refuse before loading anything
        if (emb_dir / TEACHERS).exists() and read_teachers(str(emb_dir)) is None:
            raise EmbedError(f"{teachers_problem(str(emb_dir), fix=False)}, or is not an index embed wrote; it is "
                             "left as it is: move it away, or choose another --out")
        old = (read_teachers(str(emb_dir)) or {}).get("augmentations")
        if old and old != aug and not overwrite:
            raise EmbedError(f"{emb_dir / TEACHERS} records teachers that saw other crops ({_describe(old)}); this "
                             f"run asks for {_describe(aug)}. Give the same --augmentations/--seed/--crop-scale/"
                             "--crop-ratio to add a teacher to them, or --overwrite to start the teachers again")
        existing = next(p for p in (emb_dir, *emb_dir.parents) if p.exists())
        if not existing.is_dir() or not os.access(existing, os.W_OK):
            raise EmbedError(f"{existing} is not a writable folder: give --out EMB_DIR for the teacher rows")
    proc = current_process()
    rank, world = proc.rank, proc.world_size
    results = []
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for spec in models:
            teacher = Teacher(spec, pretrained, device or str(proc.device))
            for _, emb_dir, _ in jobs:
                _refuse_twin(emb_dir, teacher, aug)
            for source, emb_dir, _ in jobs:
                (emb_dir / MARKERS).mkdir(parents=True, exist_ok=True)
                todo = [k for k, url in enumerate(source.urls)
                        if k % world == rank and (overwrite or not _done(emb_dir, url, teacher, aug))]
                n = sum(embed_shard(teacher, source.urls[k], source.sizes[k], emb_dir, aug, batch_size, pool)
                        for k in todo)
                results.append({"folder": str(emb_dir), "teacher": teacher.id, "images": n, "shards": len(todo),
                                "dim": teacher.dim, "augmentations": aug["count"]})
            proc.barrier()
            if rank == 0:
                for source, emb_dir, _ in jobs:
                    _write_index(emb_dir, source, teacher, aug)
            proc.barrier()
    return results


def weights_digest(model: torch.nn.Module) -> str:
    """A digest of a model's weights (names and bytes, in name order): one teacher under two paths is
    recognised."""
    h = hashlib.sha1()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _refuse_twin(emb_dir: Path, teacher: Teacher, aug: dict) -> None:
    """Refuse a teacher the folder's ensemble already holds under another name (a relative and an absolute
    path, an export of the same run): a second copy would count it twice."""
    index = read_teachers(str(emb_dir))
    if index is None or index["augmentations"] != aug:
        return  # no teachers, or ones that saw other crops (--overwrite drops them, or the run is refused)
    twin = next((t for t, b in index["teachers"].items() if t != teacher.id and teacher.same_as(b)), None)
    if twin:
        raise EmbedError(f"--image-model {teacher.spec}: {emb_dir / TEACHERS} already holds this teacher, embedded as "
                         f"{index['teachers'][twin]['model']} ({twin}, the same weights); a second copy would count it "
                         "twice in the ensemble. Nothing was written: give it as before to embed it again")


def _describe(aug: dict) -> str:
    return f"K={aug.get('count')}, seed {aug.get('seed')}, scale {aug.get('scale')}, ratio {aug.get('ratio')}"


def _write_index(emb_dir: Path, source, teacher: Teacher, aug: dict) -> None:
    records = [_done(emb_dir, url, teacher, aug) for url in source.urls]
    if not all(records):
        raise EmbedError(f"{emb_dir}: {records.count(None)} shard(s) not embedded by {teacher.spec}; run embed again")
    index = read_teachers(str(emb_dir)) or {}
    teachers = index.get("teachers", {}) if index.get("augmentations") == aug else {}
    if index.get("teachers") and not teachers:
        print(f"note: {emb_dir / TEACHERS}: the teachers of the earlier crops ({', '.join(index['teachers'])}) are "
              "dropped from the index (--overwrite with other crops); embed them again to use them")
    block = teacher.record()
    block["shards"] = {os.path.basename(shard_path(url)): {k: r[k] for k in ("count", "bytes", "first_key", "extra")}
                       for url, r in zip(source.urls, records)}
    block["undecodable"] = sum(r["undecodable"] for r in records)
    teachers[teacher.id] = block
    write_json_atomic(emb_dir / TEACHERS, {"version": TEACHER_VERSION, "augmentations": aug, "teachers": teachers})
