"""Image-caption selection datasets in clip_benchmark's layouts: SugarCrepe and Winoground.

Each instance holds ``I`` images and ``C`` captions, image ``i`` matching caption ``i`` for
``i < min(I, C)`` (the rest are negatives):

- **SugarCrepe** (Hsieh et al., NeurIPS 2023), as clip_benchmark's ``sugar_crepe/<split>`` reads it: a
  root folder holding COCO's ``val2017/`` images and the split's annotation file ``<split>.json``
  (``{"<id>": {"filename", "caption", "negative_caption"}}``; ids need not be contiguous). One image,
  two captions. Specs: ``sugar_crepe/SPLIT:DIR`` (one split), ``sugar_crepe:DIR`` or a plain ``DIR``
  (every split whose json is there, one result each).
- **Winoground** (Thrush et al., CVPR 2022): a Hugging Face dataset with ``image_0, image_1`` and
  ``caption_0, caption_1`` (clip_benchmark loads ``facebook/winoground``'s ``test`` split). Two images,
  two captions. Specs: ``winoground`` (the Hub ID, ``facebook/winoground``; it is gated: accept its
  terms and log in), ``winoground:ID_OR_DIR`` (another Hub ID, or a ``save_to_disk`` folder), or any
  saved dataset / ``hf:NAME[:SPLIT]`` with ``image_<i>`` and ``caption_<j>`` columns.

An annotation entry that is not what the format says (a missing caption, a filename that is not a
string) is left out and counted at load (``malformed_annotation``); an image that is missing or does not
decode is left out and counted when evaluated (``missing_image``, ``undecodable_image``).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from mmpretrain.eval.datasets import BadEvalData

SUGAR_CREPE_SPLITS = ("add_att", "add_obj", "replace_att", "replace_obj", "replace_rel", "swap_att", "swap_obj")
WINOGROUND_HUB = "facebook/winoground"


@dataclass
class SelectionInstance:
    images: list[Image.Image] | None  # None: left out (``reason``)
    captions: list[str]
    reason: str | None = None


@dataclass
class SelectionDataset:
    """``name`` as clip_benchmark names the dataset; either SugarCrepe annotations (``entries``: filename,
    captions) under ``root``, or a Hugging Face dataset (``hf``: dataset, image columns, caption columns)."""

    name: str
    root: Path | None = None
    entries: list[tuple[str, list[str]]] | None = None
    hf: tuple | None = None
    malformed: Counter = field(default_factory=Counter)  # entries left out at load, by reason
    credit: dict | None = None

    def __len__(self) -> int:
        return len(self.entries) if self.entries is not None else len(self.hf[0])

    def instance(self, i: int) -> SelectionInstance:
        if self.entries is not None:
            filename, captions = self.entries[i]
            path = self.root / filename
            if not path.is_file():
                return SelectionInstance(None, captions, "missing_image")
            image = _rgb(Image.open, path)
            return SelectionInstance(None if image is None else [image], captions,
                                     None if image is not None else "undecodable_image")
        ds, image_cols, caption_cols = self.hf
        row = ds[i]
        captions = [row[c] for c in caption_cols]
        if not all(isinstance(c, str) and c.strip() for c in captions):
            return SelectionInstance(None, [], "malformed_annotation")
        images = [_rgb(lambda im: im, row[c]) for c in image_cols]
        if any(im is None for im in images):
            return SelectionInstance(None, captions, "undecodable_image")
        return SelectionInstance(images, captions)

    def indexed(self, rank: int = 0, world: int = 1, part: int = 0, parts: int = 1) -> Iterator[tuple[int, SelectionInstance]]:
        """``(i, instance)`` for ``i % world == rank`` and ``(i // world) % parts == part``, as
        :meth:`mmpretrain.eval.datasets.EvalDataset.indexed` splits samples."""
        for i in range(rank, len(self), world):
            if (i // world) % parts == part:
                yield i, self.instance(i)


def _rgb(open_image, source) -> Image.Image | None:
    try:
        return open_image(source).convert("RGB")
    except Exception:  # PIL raises many kinds for bad bytes
        return None


def _sugar_crepe_root(spec: str) -> tuple[str | None, Path] | None:
    """``(split or None, root)`` when ``spec`` names SugarCrepe (prefix or layout), else None."""
    m = re.fullmatch(r"sugar_crepe(?:/([a-z_]+))?:(.+)", spec)
    if m:
        return m.group(1), Path(m.group(2))
    root = Path(spec)
    if root.is_dir() and (root / "val2017").is_dir() and any((root / f"{s}.json").is_file() for s in SUGAR_CREPE_SPLITS):
        return None, root
    return None


def expand_spec(spec: str) -> list[str]:
    """A spec naming every SugarCrepe split of a folder becomes one spec per split present there
    (``sugar_crepe/SPLIT:DIR``); any other spec stays as it is. Raises FileNotFoundError when the folder
    holds none."""
    found = _sugar_crepe_root(spec)
    if found is None or found[0] is not None:
        return [spec]
    root = found[1]
    present = [s for s in SUGAR_CREPE_SPLITS if (root / f"{s}.json").is_file()]
    if not present:
        raise FileNotFoundError(f"--dataset {spec}: no SugarCrepe annotation file in {root} (one of "
                                f"{', '.join(s + '.json' for s in SUGAR_CREPE_SPLITS)}; clip_benchmark fetches them "
                                "from github.com/RAIVNLab/sugar-crepe/tree/main/data)")
    return [f"sugar_crepe/{s}:{root}" for s in present]


def load_selection(spec: str) -> SelectionDataset:
    """The dataset a spec names (see the module doc). Raises FileNotFoundError / BadEvalData naming it."""
    found = _sugar_crepe_root(spec)
    if found is not None:
        split, root = found
        if split is None:
            raise ValueError(f"--dataset {spec}: several SugarCrepe splits; expand_spec gives one spec per split")
        return _sugar_crepe(spec, split, root)
    if spec == "winoground" or spec.startswith("winoground:"):
        source = spec.partition(":")[2] or WINOGROUND_HUB
        return _hf_selection(spec, source, "winoground")
    if spec.startswith("hf:"):
        hub, _, split = spec[3:].partition(":")
        return _hf_selection(spec, hub, hub.replace("/", "_"), split or "test")
    root = Path(spec)
    if root.is_dir() and ((root / "dataset_info.json").is_file() or (root / "state.json").is_file()
                          or (root / "dataset_dict.json").is_file()):
        return _hf_selection(spec, str(root), root.resolve().name)
    if not root.exists():
        raise FileNotFoundError(f"--dataset {spec}: no such folder")
    raise FileNotFoundError(
        f"--dataset {spec}: image_caption_selection takes SugarCrepe (a folder with val2017/ and <split>.json, "
        "or sugar_crepe[/SPLIT]:DIR), Winoground (winoground, winoground:DIR for a save_to_disk copy) or a "
        "saved dataset with image_<i> and caption_<j> columns")


def _sugar_crepe(spec: str, split: str, root: Path) -> SelectionDataset:
    if split not in SUGAR_CREPE_SPLITS:
        raise FileNotFoundError(f"--dataset {spec}: {split!r} is not a SugarCrepe split ({', '.join(SUGAR_CREPE_SPLITS)})")
    ann = root / f"{split}.json"
    if not ann.is_file():
        raise FileNotFoundError(f"--dataset {spec}: no {ann} (clip_benchmark fetches it from "
                                f"https://raw.githubusercontent.com/RAIVNLab/sugar-crepe/main/data/{split}.json)")
    if not (root / "val2017").is_dir():
        raise FileNotFoundError(f"--dataset {spec}: no {root / 'val2017'} (COCO's val2017 images: "
                                "http://images.cocodataset.org/zips/val2017.zip, unzipped there)")
    try:
        data = json.loads(ann.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise BadEvalData(f"--dataset {spec}: {ann} is not JSON ({e}): fetch it again") from None
    if not isinstance(data, dict):
        raise BadEvalData(f"--dataset {spec}: {ann} holds a {type(data).__name__}, not SugarCrepe's "
                          "{id: {filename, caption, negative_caption}} object")
    entries, malformed = [], Counter()
    for value in data.values():  # clip_benchmark's order: the json's keys as written
        ok = isinstance(value, dict) and all(isinstance(value.get(k), str) and value[k].strip()
                                             for k in ("filename", "caption", "negative_caption"))
        if ok:
            entries.append((value["filename"], [value["caption"], value["negative_caption"]]))
        else:
            malformed["malformed_annotation"] += 1
    if not entries:
        raise BadEvalData(f"--dataset {spec}: {ann} holds no usable entry ({len(data)} entries)")
    return SelectionDataset(f"sugar_crepe/{split}", root=root / "val2017", entries=entries, malformed=malformed)


def _columns(cols: list[str], prefix: str) -> list[str]:
    found = sorted((int(m.group(1)), c) for c in cols if (m := re.fullmatch(prefix + r"_(\d+)", c)))
    return [c for i, (j, c) in enumerate(found) if i == j]


def _hf_selection(spec: str, source: str, name: str, split: str = "test") -> SelectionDataset:
    # datasets is a heavy import, needed only here
    import datasets

    path = Path(source)
    try:
        if path.is_dir():
            ds = datasets.load_from_disk(str(path))
        else:
            ds = datasets.load_dataset(source, split=split)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"--dataset {spec}: {e}") from None
    except Exception as e:  # the Hub: offline, gated (Winoground needs its terms accepted and a login), ...
        raise FileNotFoundError(f"--dataset {spec}: {source} could not be loaded ({e.__class__.__name__}: "
                                f"{str(e)[:300]}); Winoground is gated on the Hub: accept its terms at "
                                f"https://huggingface.co/datasets/{WINOGROUND_HUB} and log in, or pass a "
                                "save_to_disk copy (winoground:DIR)") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise FileNotFoundError(f"--dataset {spec}: {source} has no {split!r} split (it has {list(ds)})")
        ds = ds[split]
    images, captions = _columns(ds.column_names, "image"), _columns(ds.column_names, "caption")
    if not images or not captions:
        raise FileNotFoundError(f"--dataset {spec}: image_caption_selection needs columns image_0[, image_1 ...] "
                                f"and caption_0[, caption_1 ...]; {source} has {ds.column_names}")
    return SelectionDataset(name, hf=(ds, images, captions))
