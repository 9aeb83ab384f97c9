"""What the trainer reports: log records (terms summed over ranks), geometry diagnostics of the
gathered batch, evaluations during training, and the numeric view the trackers take."""

from __future__ import annotations

import math
import time
from collections import Counter
from typing import Any

import torch


def log_record(run: Any, out: dict[str, torch.Tensor], since: float, steps: int) -> dict[str, Any]:
    acc = run.accelerator
    keys = sorted(k for k in out if k.endswith("_loss") or k.endswith("_unweighted") or k == "loss")
    vals = acc.reduce(torch.stack([out[k].detach().float() for k in keys]).to(acc.device), reduction="mean")
    rec: dict[str, Any] = {"step": run.step, "samples": run.samples,
                           "epoch": run.samples / run.schedule["num_samples"], "lr": float(out["lr"])}
    rec.update({k: float(v) for k, v in zip(keys, vals.tolist())})
    for k, v in out.items():  # the objective's own diagnostics ("regions/m5/q_entropy", ...), equal on every rank
        if "/" in k and isinstance(v, torch.Tensor):
            v = v.detach().float().cpu()
            if v.numel() > 1:
                rec[k] = v.tolist()
            elif math.isfinite(float(v)):
                rec[k] = float(v)
    rec["logit_scale"] = float(acc.unwrap_model(run.model).clip.logit_scale.detach().exp())
    rec["samples_per_s"] = steps * run.schedule["global_batch_size"] / max(time.time() - since, 1e-9)
    rec["skipped"] = all_ranks_skipped(run)
    rec["nonfinite_steps"] = run.nonfinite_steps
    return rec


def all_ranks_skipped(run: Any) -> dict[str, int]:
    """Bad and dropped samples by reason, summed over ranks."""
    from accelerate.utils import gather_object

    total: Counter = Counter()
    for counts in gather_object([dict(run.skipped)]) if run.accelerator.num_processes > 1 else [run.skipped]:
        total.update(counts)
    return dict(sorted(total.items()))


def numeric(rec: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Flat ``name -> number`` for tensorboard/wandb (nested dicts become ``a/b``)."""
    out: dict[str, float] = {}
    for k, v in rec.items():
        if isinstance(v, dict):
            out.update(numeric(v, f"{prefix}{k}/"))
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
            out[prefix + k] = float(v)
    return out


def diagnostics(run, out: dict[str, Any]) -> dict[str, float]:
    """Geometry of the global batch (every rank's features gathered; called on every rank)."""
    from mmpretrain.metrics import geometry, similarity_histogram

    x, y = out["features"]
    acc = run.accelerator
    x, y = acc.gather(x.float().contiguous()), acc.gather(y.float().contiguous())
    run.histograms = similarity_histogram(x, y)
    return {f"geometry/{k}": v for k, v in geometry(x, y).items()}


def evaluate(run) -> dict[str, Any]:
    """The configured evaluations on every rank; results.json gets them under model ``step_N``."""
    from mmpretrain.eval import Evaluator, merge_results

    cfg, acc = run.cfg.eval, run.accelerator
    clip = acc.unwrap_model(run.model).clip
    entries = Evaluator(cfg.jobs, batch_size=cfg.batch_size, device=str(acc.device),
                        num_workers=cfg.num_workers).run(clip, run.preprocess, run.tokenizer,
                                                        model_name=f"step_{run.step}")
    rec: dict[str, Any] = {"step": run.step}
    for e in entries:
        for k, v in e["metrics"].items():
            rec[f"eval/{e['dataset']}/{k}"] = v
    if acc.is_main_process:
        merge_results(run.run_dir / "results.json", entries)
    return rec
