"""Forward and backward of one step's batch, whole or in micro-batches.

``mode="grad_cache"`` (Gao et al. 2021, "Scaling Deep Contrastive Learning Batch Size under Memory
Limited Setup"): a no-grad forward over the micro-batches caches the features; the objective runs
once on the whole batch with the features (and the logit scale and bias) as leaves, in at least fp32
with autocast off (its backward is not under the fp16 loss scaler), and backward gives ``dL/dfeatures``; each micro-batch is then forwarded again with grad and back-propagated with its
slice of those gradients (the scale's and bias's gradients enter with the last one). The parameter
gradient equals the whole batch's for towers without batch statistics: random ops (dropout, patch
dropout) are replayed by restoring each micro-batch's RNG state before its second forward; BatchNorm
sees micro-batch statistics in both forwards, so a BatchNorm tower (ResNets) gets the micro-batch
objective's normalisation, not the big batch's. Memory: activations of one micro-batch plus the
features of the batch; time: one extra forward of both towers.

``mode="accumulate"``: each micro-batch is a separate objective (its own negatives, its own
normalisation) and the gradients are averaged, as plain gradient accumulation does. That is a
different, weaker objective than the whole batch's (fewer negatives per positive); it exists for
comparison and for objectives that do not decompose.

Under DDP gradients synchronise only on the last micro-batch (``accelerator.no_sync``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from mmpretrain.data.naflex import patch_rows
from mmpretrain.losses.base import total_of


@dataclass
class StepResult:
    """One step's forward and backward: the objective's ``terms`` (detached: ``*_loss`` weighted,
    ``*_unweighted``, diagnostics), their sum ``loss``, this rank's ``features`` (image, text) for the
    diagnostics, whether the loss was ``finite`` (when not, the caller must discard the gradients), and
    the ``logit_scale`` the forward used (read off the forward: under FSDP a rank that does not hold
    the parameter's shard sees it empty)."""

    terms: dict[str, Any]
    loss: torch.Tensor
    features: tuple[torch.Tensor, torch.Tensor]
    finite: bool | torch.Tensor = True
    logit_scale: torch.Tensor | None = None


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _full(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _sub(x, s):
    """Rows ``s`` of a batch tensor, or of each tensor of a NaFlex image dict (patches, coordinates, mask)."""
    if isinstance(x, dict):
        return patch_rows(x, s)
    return None if x is None else x[s]


def _first(images):
    """The images' tensor (a NaFlex dict's patches): its rows and device are the batch's."""
    return images["patches"] if isinstance(images, dict) else images


def for_objective(feats: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The forward's outputs as the objective takes them: half-precision features outside autocast
    (DeepSpeed's bf16/fp16 weights run without it) are cast up to fp32, as autocast would for the
    objective's softmax and log-sum-exp; under autocast or in fp32, unchanged."""
    if torch.is_autocast_enabled(device.type):
        return feats
    return {k: v.float() if isinstance(v, torch.Tensor) and v.dtype in (torch.bfloat16, torch.float16) else v
            for k, v in feats.items()}


def forward_backward(accelerator, model, objective, images, tokens=None, target_emb=None, *,
                     micro_batch: int | None = None, mode: str = "grad_cache",
                     finite: Callable[[torch.Tensor], bool] | None = None,
                     context: dict[str, Any] | None = None, **model_kw) -> StepResult:
    """Gradients of the step's loss into the parameters. ``context``: the step context the objective
    receives as keywords (``step``, ``epoch``, and what it declares it needs: ``labels (B,)``,
    ``sample_index (B,)``); per-sample tensors in it are sliced with the micro-batches in accumulate mode.

    ``finite(loss) -> bool | Tensor`` decides whether the loss can be used (the trainer's check agrees
    across ranks). A bool is read on the host: with the whole batch, and with grad caching, it is called
    before any backward of the towers and a False skips them. A 0-dim bool tensor stays on the device:
    the backward always runs, and the caller skips the update on the device where it is False (the
    gradients of a non-finite loss are discarded with it). In accumulate mode every micro-batch's
    backward has already run when the total is known; a False there only marks the result, and the
    caller discards the accumulated gradients (as it must in every mode when ``finite`` is False).
    ``model_kw``: the model's other keywords (:attr:`~mmpretrain.train.task.StepInputs.model_kw`), tensors
    sliced with the micro-batches: ``negative_tokens (B, L)``, hard-negative captions encoded with the
    captions (``negative_text_features``); ``encodings``: the model also returns the image tower's
    pre-projection ``image_encodings`` (detached); ``patch_keep (B, K)``: the patches the image tower keeps,
    so that grad caching's second forward of a micro-batch drops the patches its first did; ``caption``:
    the caption decoder's logits (not with grad caching: the decoder's loss is per sample, no batch term
    to cache)."""
    acc = accelerator
    B = _first(images).shape[0]
    kw = context or {}
    neg = {k: v for k, v in model_kw.items() if v is not None and v is not False}
    negative_tokens, encodings = neg.get("negative_tokens"), bool(neg.get("encodings"))

    def sub_neg(s):
        return {k: v[s] if isinstance(v, torch.Tensor) else v.rows(s) if hasattr(v, "rows") else v
                for k, v in neg.items()}

    if not micro_batch or micro_batch >= B:
        with acc.autocast():
            feats = for_objective(model(images, tokens=tokens, target_embeddings=target_emb, **neg),
                                  _first(images).device)
            out = objective(**feats, target_embeddings=target_emb, **kw)
        total = total_of(out)
        ok = True if finite is None else finite(total)
        if isinstance(ok, torch.Tensor) or ok:
            acc.backward(total)
        return _result(out, total, feats["image_features"], feats["text_features"], ok, feats["logit_scale"])
    chunks = [slice(i, min(i + micro_batch, B)) for i in range(0, B, micro_batch)]
    if mode == "accumulate":
        outs, fi, ft = [], [], []
        for j, s in enumerate(chunks):
            with acc.no_sync(model) if j < len(chunks) - 1 else nullcontext():
                with acc.autocast():
                    feats = for_objective(model(_sub(images, s), tokens=_sub(tokens, s), target_embeddings=_sub(target_emb, s),
                                                **sub_neg(s)), _first(images).device)
                    o = objective(**feats, target_embeddings=_sub(target_emb, s),
                                  **{k: _sub(v, s) if isinstance(v, torch.Tensor) else v for k, v in kw.items()})
                acc.backward(total_of(o) / len(chunks))
            outs.append({k: v.detach() for k, v in o.items()})
            fi.append(feats["image_features"].detach())
            ft.append(feats["text_features"].detach())
        out = {k: sum(o[k] for o in outs) / len(outs) for k in outs[0]}
        total = total_of(out)
        ok = True if finite is None else finite(total)
        return _result(out, total, torch.cat(fi), torch.cat(ft), ok, feats["logit_scale"])
    if mode != "grad_cache":
        raise ValueError(f"train.micro_batch_mode={mode!r}: grad_cache or accumulate")
    if neg.get("caption") or neg.get("ssl") is not None:
        raise ValueError(f"the {'caption' if neg.get('caption') else 'self-supervised'} objective with "
                         "train.micro_batch_mode=grad_cache: its loss is per sample, with no batch term to cache; use "
                         "train.micro_batch_mode=accumulate")
    device = _first(images).device
    states, img, txt, negs, encs = [], [], [], [], []
    with torch.no_grad():
        for s in chunks:
            states.append(_rng_state(device))
            with acc.autocast():
                f = model(_sub(images, s), tokens=_sub(tokens, s), target_embeddings=_sub(target_emb, s), **sub_neg(s))
            img.append(f["image_features"])
            txt.append(f["text_features"])
            if negative_tokens is not None:
                negs.append(f["negative_text_features"])
            if encodings:  # targets' inputs: no gradient, so cached as they are
                encs.append(f["image_encodings"])
    after = _rng_state(device)
    # the scale and bias as the forward uses them (clamped; 0-dim), not read off the parameters: under
    # FSDP a rank holds only its shard of them (often nothing)
    scale = _full(f["logit_scale"].detach()).requires_grad_()
    bias = _full(f["logit_bias"].detach()).requires_grad_() if f["logit_bias"] is not None else None
    # The objective's backward runs here, outside the fp16 GradScaler: its dL/dfeatures (~1/N^2) would
    # underflow in fp16 at large N. So it runs in (at least) fp32 on up-cast features, autocast off;
    # the towers' backward below goes through accelerator.backward, scaled as usual.
    img = _full(torch.cat(img).detach()).requires_grad_()
    txt = _full(torch.cat(txt).detach()).requires_grad_()
    cached_neg = _full(torch.cat(negs).detach()).requires_grad_() if negs else None
    with torch.autocast(device.type, enabled=False):
        out = objective(image_features=img, text_features=txt, logit_scale=scale, logit_bias=bias,
                        target_embeddings=target_emb, **kw,
                        **({"negative_text_features": cached_neg} if cached_neg is not None else {}),
                        **({"image_encodings": torch.cat(encs)} if encs else {}))
    total = total_of(out)
    ok = True if finite is None else finite(total)
    if not isinstance(ok, torch.Tensor) and not ok:
        return _result(out, total, img, txt, False, scale)
    total.backward()
    for j, s in enumerate(chunks):
        last = j == len(chunks) - 1
        _set_rng_state(states[j], device)
        with acc.no_sync(model) if not last else nullcontext():
            with acc.autocast():
                f = model(_sub(images, s), tokens=_sub(tokens, s), target_embeddings=_sub(target_emb, s), **sub_neg(s))
                surrogate = (f["image_features"] * img.grad[s]).sum() + (f["text_features"] * txt.grad[s]).sum()
                if cached_neg is not None and cached_neg.grad is not None:
                    surrogate = surrogate + (f["negative_text_features"] * cached_neg.grad[s]).sum()
                if last and scale.grad is not None:
                    surrogate = surrogate + (f["logit_scale"] * scale.grad).sum()
                if last and bias is not None and bias.grad is not None:
                    surrogate = surrogate + (f["logit_bias"] * bias.grad).sum()
            acc.backward(surrogate)
    _set_rng_state(after, device)
    return _result(out, total, img, txt, ok, scale)


def _result(out: dict[str, Any], total: torch.Tensor, image_features, text_features, finite: bool | torch.Tensor = True,
            logit_scale: torch.Tensor | None = None) -> StepResult:
    terms = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in out.items()}
    return StepResult(terms, total.detach(), (image_features.detach(), text_features.detach()), finite,
                      logit_scale.detach() if logit_scale is not None else None)
