"""Evaluation: zero-shot classification and retrieval, linear probe, k-NN, clustering, captioning and image-caption
selection (SugarCrepe, Winoground), under clip_benchmark's metric names, each entry of ``results.json`` with its chance levels.

One module per task, each with its metrics and its runner ``run(model, preprocess, tokenizer, data,
ctx) -> {"n", "metrics", "chance", ...}``; :data:`TASKS` is the registry. :func:`evaluate` runs one
(dataset, task); :class:`Evaluator` several, as the trainer calls it. With ``ctx.world_size > 1``
(``accelerate launch``) every task splits the images across ranks and gathers them
(:mod:`mmpretrain.eval.context`): results equal one process's and are identical on every rank.

Adding a task: a module with ``run``, an entry in :data:`TASKS` (saying which data it takes), a
test against a naive reference and the 2-rank parity test in ``tests/test_eval.py``.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from mmpretrain.eval import (
    captioning,
    clustering,
    dense_probe,
    knn,
    linear_probe,
    retrieval,
    selection,
    zero_shot,
)
from mmpretrain.eval.context import EvalContext, gather
from mmpretrain.eval.datasets import EvalDataset, load_dataset, load_splits
from mmpretrain.eval.selection_data import SelectionDataset, expand_spec, load_selection


@dataclass(frozen=True)
class Task:
    """``run(model, preprocess, tokenizer, data, ctx)``; ``data``: what it is given -- ``dataset`` (one
    :class:`EvalDataset`), ``splits`` (train and test), ``test_split`` (``(None, test)``) or ``selection``
    (one :class:`SelectionDataset`)."""

    run: Callable[..., dict[str, Any]]
    data: Literal["dataset", "splits", "test_split", "selection"]


TASKS: dict[str, Task] = {
    "zeroshot_classification": Task(zero_shot.run, "dataset"),
    "zeroshot_retrieval": Task(retrieval.run, "dataset"),
    "linear_probe": Task(linear_probe.run, "splits"),
    "knn": Task(knn.run, "splits"),
    "clustering": Task(clustering.run, "test_split"),
    "image_caption_selection": Task(selection.run, "selection"),
    "captioning": Task(captioning.run, "dataset"),
    "dense_probe": Task(dense_probe.run, "splits"),
}

TaskData = EvalDataset | tuple[EvalDataset | None, EvalDataset] | SelectionDataset


def expand_jobs(jobs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """``(spec, task)`` pairs with a spec naming several datasets (every SugarCrepe split of a folder)
    made one pair per dataset. Raises FileNotFoundError naming the spec."""
    return [(s, task) for spec, task in jobs
            for s in (expand_spec(spec) if TASKS.get(task) and TASKS[task].data == "selection" else [spec])]


def load_task_data(spec: str, task: str) -> TaskData:
    """What ``task`` runs on, from a dataset spec (raises FileNotFoundError / ValueError naming it)."""
    if task not in TASKS:
        raise ValueError(f"task {task!r} is not one of {', '.join(TASKS)}")
    kind = TASKS[task].data
    if kind == "selection":
        return load_selection(spec)
    if kind == "dataset":
        return load_dataset(spec)
    return load_splits(spec, need_train=kind == "splits")


def evaluate(model, preprocess, tokenizer, data: str | Path | TaskData, task: str, *, model_name: str = "",
             batch_size: int = 256, recall_k: list[int] | None = None, device: str = "cpu", num_workers: int = 0,
             rank: int = 0, world_size: int = 1, features: dict | None = None,
             generation: dict | None = None) -> dict[str, Any]:
    """One ``results.json`` entry. ``data``: a dataset spec, or what :func:`load_task_data` returns.
    Under several processes every rank calls this with its ``rank`` (the default process group gathers).
    ``features``: one dict passed to every call on the same model, so tasks on the same dataset share
    its image pass (the model must not change between those calls). ``generation``: captioning's options
    (``num_beams``, ``max_len``, ``min_len``)."""
    if isinstance(data, (str, Path)):
        data = load_task_data(str(data), task)
    ctx = EvalContext(batch_size=batch_size, device=device, num_workers=num_workers,
                      recall_k=tuple(recall_k or (1, 5, 10)), rank=rank, world_size=world_size,
                      features=features, generation=generation)
    model.eval()
    res = TASKS[task].run(model, preprocess, tokenizer, data, ctx)
    ds = data if isinstance(data, (EvalDataset, SelectionDataset)) else data[1]
    name = ds.name
    skipped = sum((Counter(c) for c in gather(dict(ctx.skipped), world_size)), Counter())
    if skipped and rank == 0:
        print(f"warning: {name} {task}: skipped {dict(skipped)} (left out of every metric)", file=sys.stderr)
    return {"dataset": name, "task": task, "model": model_name, **res, **({"skipped": dict(skipped)} if skipped else {}),
            **({"data": ds.credit} if ds.credit else {})}


@dataclass
class Evaluator:
    """``run(model, preprocess, tokenizer) -> list of results entries`` for several (dataset, task);
    a dataset is a spec or what :func:`load_task_data` returned for it (loaded once, up front)."""

    jobs: list[tuple[str | TaskData, str]]
    batch_size: int = 256
    recall_k: list[int] = field(default_factory=lambda: [1, 5, 10])
    device: str = "cpu"
    num_workers: int = 0
    rank: int = 0
    world_size: int = 1

    def run(self, model, preprocess, tokenizer, model_name: str = "") -> list[dict[str, Any]]:
        """Call on every rank (the work is split and gathered); the model's train/eval mode is restored."""
        was_training = model.training
        features: dict = {}  # this call's model: its tasks on one dataset share the image pass
        try:
            entries = [evaluate(model, preprocess, tokenizer, d, t, model_name=model_name,
                                batch_size=self.batch_size, recall_k=self.recall_k, device=self.device,
                                num_workers=self.num_workers, rank=self.rank, world_size=self.world_size,
                                features=features)
                       for d, t in self.jobs]
            for e in entries:  # a training log keeps the scores, not every generated caption
                e.pop("captions", None)
            return entries
        finally:
            model.train(was_training)


def check_results_file(path: str | Path) -> None:
    """``--output`` must be a results file this command can add to (or not exist yet, in a folder that
    can hold it), checked before any evaluation runs. Raises ValueError naming it."""
    path = Path(path)
    for parent in path.parents:
        if parent.exists() and not parent.is_dir():
            raise ValueError(f"--output {path}: {parent} is a file, not a folder")
    if path.is_dir():
        raise ValueError(f"--output {path} is a folder: give a file, e.g. {path / 'results.json'}")
    if not path.exists():
        return
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        data = None
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        raise ValueError(f"--output {path} exists and is not a results file (a JSON object with a 'results' "
                         "list): choose another path; it is left as it is")


def merge_results(path: str | Path, entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Add ``entries`` to ``path`` (replacing ones with the same dataset, task and model)."""
    path = Path(path)
    data = json.loads(path.read_text()) if path.is_file() else {"results": []}
    ident = lambda e: (e["dataset"], e["task"], e["model"])  # noqa: E731
    new = {ident(e) for e in entries}
    data["results"] = [e for e in data.get("results", []) if ident(e) not in new] + entries
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return data


def format_table(entries: list[dict[str, Any]]) -> str:
    """The entries' metrics beside chance; a model column when they hold several (a WiSE-FT sweep)."""
    several = len({e.get("model") for e in entries}) > 1
    rows = [(*(("model",) if several else ()), "dataset", "task", "metric", "value", "chance", "x chance")]
    for e in entries:
        for k, v in e["metrics"].items():
            ch = e.get("chance", {}).get(k)
            rows.append((*((str(e.get("model")),) if several else ()), e["dataset"], e["task"], k, f"{v:.4f}",
                         f"{ch:.4f}" if ch is not None else "-", f"{v / ch:.1f}" if ch else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


__all__ = ["TASKS", "EvalContext", "EvalDataset", "Evaluator", "SelectionDataset", "Task", "evaluate", "expand_jobs",
           "format_table", "load_task_data", "merge_results"]
