"""Evaluation: zero-shot classification and retrieval, linear probe, k-NN and clustering, under
clip_benchmark's metric names, ``results.json`` with chance levels. ``Evaluator(...).run(model)`` is
what a trainer calls. Under ``accelerate launch`` every task splits the images across ranks and gathers
them (``mmpretrain.eval.loop``): results equal one process's and are identical on every rank."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mmpretrain.eval.datasets import EvalDataset, load_dataset
from mmpretrain.eval.loop import batches, gather_in_order, split_map
from mmpretrain.eval.retrieval import retrieval_chance, retrieval_metrics
from mmpretrain.eval.zero_shot import (
    DEFAULT_TEMPLATES,
    build_classifier,
    classification_chance,
    classification_metrics,
)

TASKS = ("zeroshot_classification", "zeroshot_retrieval", "linear_probe", "knn", "clustering")
PROBE_TASKS = ("linear_probe", "knn", "clustering")


@torch.no_grad()
def zeroshot_classification(model, preprocess, tokenizer, ds: EvalDataset, batch_size: int, device,
                            num_workers: int = 0) -> dict:
    if not ds.classnames:
        raise ValueError(f"{ds.name}: no class names (classnames.txt or the manifest's classnames)")
    templates = ds.templates or list(DEFAULT_TEMPLATES)
    # class embeddings split across ranks, gathered in class order: (C, D) -> (D, C)
    w = split_map(lambda names: build_classifier(model, tokenizer, names, templates, device).T, ds.classnames)
    w = w.T.to(device)
    index, logits, labels = [], [], []
    for idx, images, _, labs in batches(ds, preprocess, batch_size, num_workers, labelled_only=True,
                                        desc=f"{ds.name} zero-shot"):
        feats = model.encode_image(images.to(device), normalize=True)
        logits.append((feats @ w.to(feats.dtype)).float().cpu())
        labels += labs
        index.append(idx)
    local = {"logits": torch.cat(logits) if logits else torch.empty(0),
             "labels": torch.tensor(labels, dtype=torch.long)}
    out, _ = gather_in_order(local, torch.cat(index) if index else torch.empty(0, dtype=torch.long))
    if out["labels"] is None:
        raise ValueError(f"{ds.name}: no labelled samples for zero-shot classification")
    c = len(ds.classnames)
    return {"n": len(out["labels"]), "metrics": classification_metrics(out["logits"], out["labels"], c),
            "chance": classification_chance(c)}


@torch.no_grad()
def zeroshot_retrieval(model, preprocess, tokenizer, ds: EvalDataset, batch_size: int, device,
                       recall_k: list[int], num_workers: int = 0) -> dict:
    index, img_feats, txt_feats, counts = [], [], [], []
    for idx, images, captions, _ in batches(ds, preprocess, batch_size, num_workers,
                                             desc=f"{ds.name} retrieval"):
        img_feats.append(model.encode_image(images.to(device), normalize=True).float().cpu())
        texts = [c for caps in captions for c in caps]
        for i in range(0, len(texts), batch_size):
            tok = tokenizer(texts[i:i + batch_size]).to(device)
            txt_feats.append(model.encode_text(tok, normalize=True).float().cpu())
        counts += [len(caps) for caps in captions]
        index.append(idx)
    # captions travel as one list per image so they stay with their image when sorted by index
    per_image_txt, start = [], 0
    flat = torch.cat(txt_feats) if txt_feats else torch.empty(0)
    for n in counts:
        per_image_txt.append(flat[start:start + n])
        start += n
    local = {"images": torch.cat(img_feats) if img_feats else torch.empty(0), "texts": per_image_txt}
    out, _ = gather_in_order(local, torch.cat(index) if index else torch.empty(0, dtype=torch.long))
    per_image = [len(t) for t in out["texts"]]
    if out["images"] is None or not sum(per_image):
        raise ValueError(f"{ds.name}: no captions for retrieval")
    owner = torch.tensor([i for i, n in enumerate(per_image) for _ in range(n)])
    texts = torch.cat([t for t in out["texts"] if len(t)])
    image_features = out["images"]
    return {"n": image_features.shape[0],
            "metrics": retrieval_metrics(image_features, texts, owner, recall_k),
            "chance": retrieval_chance(image_features.shape[0], [c for c in per_image if c > 0] or [1], recall_k)}


def _num_classes(ds: EvalDataset, *labels: torch.Tensor) -> int:
    return len(ds.classnames) if ds.classnames else int(max(int(y.max()) for y in labels)) + 1


def probe(model, preprocess, ds_train: EvalDataset | None, ds_test: EvalDataset, task: str, batch_size: int,
          device, num_workers: int = 0) -> dict:
    """linear_probe / knn (train + test) or clustering (test), on projected and pre-projection features."""
    from mmpretrain.eval.clustering import clustering_metrics
    from mmpretrain.eval.features import image_features
    from mmpretrain.eval.knn import knn_accuracy
    from mmpretrain.eval.linear_probe import linear_probe

    te_x, te_pre, te_y = image_features(model, preprocess, ds_test, batch_size, device, num_workers)
    if task == "clustering":
        c = _num_classes(ds_test, te_y)
        metrics = clustering_metrics(te_x, te_y, c)
        chance = {"ari": 0.0}  # the expected ARI of a random partition
        if te_pre is not None:
            metrics.update({f"{k}_preproj": v for k, v in clustering_metrics(te_pre, te_y, c).items()})
            chance["ari_preproj"] = 0.0
        return {"n": len(te_y), "metrics": metrics, "chance": chance}
    tr_x, tr_pre, tr_y = image_features(model, preprocess, ds_train, batch_size, device, num_workers)
    c = _num_classes(ds_test, te_y, tr_y)
    chance = classification_chance(c)
    pairs = [("", tr_x, te_x)] + ([("_preproj", tr_pre, te_pre)] if te_pre is not None else [])
    metrics: dict[str, float] = {}
    extra: dict[str, Any] = {"n_train": len(tr_y)}
    for suffix, tr, te in pairs:
        if task == "linear_probe":
            m, best_c = linear_probe(tr, tr_y, te, te_y, c)
            metrics.update({k + suffix: v for k, v in m.items()})
            extra[f"C{suffix}"] = best_c
        else:
            metrics[f"knn_acc1{suffix}"] = knn_accuracy(tr, tr_y, te, te_y, c)
    base = {f"lp_{k}": v for k, v in chance.items()} if task == "linear_probe" else {"knn_acc1": chance["acc1"]}
    chance = {k + suffix: v for suffix, _, _ in pairs for k, v in base.items()}
    return {"n": len(te_y), "metrics": metrics, "chance": chance, **extra}


def evaluate(model, preprocess, tokenizer, dataset: str | EvalDataset, task: str, *, model_name: str = "",
             batch_size: int = 256, recall_k: list[int] | None = None, device: str = "cpu",
             num_workers: int = 0) -> dict[str, Any]:
    """One ``results.json`` entry."""
    if task in PROBE_TASKS:
        from mmpretrain.eval.datasets import load_splits

        ds_train, ds_test = load_splits(dataset, need_train=task != "clustering")
        model.eval()
        res = probe(model, preprocess, ds_train, ds_test, task, batch_size, device, num_workers)
        return {"dataset": ds_test.name, "task": task, "model": model_name, **res}
    ds = load_dataset(dataset) if isinstance(dataset, str) else dataset
    model.eval()
    if task == "zeroshot_classification":
        res = zeroshot_classification(model, preprocess, tokenizer, ds, batch_size, device, num_workers)
    elif task == "zeroshot_retrieval":
        res = zeroshot_retrieval(model, preprocess, tokenizer, ds, batch_size, device, recall_k or [1, 5, 10],
                                 num_workers)
    else:
        raise ValueError(f"task {task!r} is not available yet; choose one of {TASKS}")
    return {"dataset": ds.name, "task": task, "model": model_name, **res}


@dataclass
class Evaluator:
    """``run(model, preprocess, tokenizer) -> list of results entries`` for several (dataset, task)."""

    jobs: list[tuple[str, str]]
    batch_size: int = 256
    recall_k: list[int] = field(default_factory=lambda: [1, 5, 10])
    device: str = "cpu"
    num_workers: int = 0

    def run(self, model, preprocess, tokenizer, model_name: str = "") -> list[dict[str, Any]]:
        """Call on every rank (the work is split and gathered); the model's train/eval mode is restored."""
        was_training = model.training
        try:
            return [evaluate(model, preprocess, tokenizer, d, t, model_name=model_name, batch_size=self.batch_size,
                             recall_k=self.recall_k, device=self.device, num_workers=self.num_workers)
                    for d, t in self.jobs]
        finally:
            model.train(was_training)


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
    rows = [("dataset", "task", "metric", "value", "chance", "x chance")]
    for e in entries:
        for k, v in e["metrics"].items():
            ch = e.get("chance", {}).get(k)
            rows.append((e["dataset"], e["task"], k, f"{v:.4f}", f"{ch:.4f}" if ch is not None else "-",
                         f"{v / ch:.1f}" if ch else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
