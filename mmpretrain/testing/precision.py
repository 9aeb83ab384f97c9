"""Every objective under autocast against fp32: value and feature gradient on one structured batch.
Shared by tests/test_precision.py (CPU autocast) and scripts/gpu_bench.py (CUDA autocast on a lent GPU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmpretrain.losses import LOSSES

TILED = ("clip", "sigmoid", "soft_target")
CASES = [("clip", {}), ("clip", {"local_loss": True}), ("sigmoid", {}), ("sigmoid", {"within_view_negatives": True}),
         ("soft_target", {}), ("soft_target", {"space": "image_image"}), ("cwcl", {}), ("vrn", {"delta": 0.0}),
         ("align_uniform", {}), ("global_clip", {"index_size": 1 << 16})]


def amp_cases(chunk: int) -> list[tuple[str, dict, int | None]]:
    """Each case untiled, and tiled at ``chunk`` where the objective tiles."""
    return [(n, o, c) for n, o in CASES for c in ([None, chunk] if n in TILED else [None])]


def structured_batch(n: int, d: int, e: int, device="cpu") -> tuple[torch.Tensor, ...]:
    """Unit features where each row's positive stands out (as after some training), a second view and
    targets correlated with the images."""
    g = torch.Generator().manual_seed(0)
    x = F.normalize(torch.randn(n, d, generator=g), dim=-1)
    y = F.normalize(x + 0.3 * torch.randn(n, d, generator=g), dim=-1)
    x2 = F.normalize(x + 0.3 * torch.randn(n, d, generator=g), dim=-1)
    t = F.normalize(x[:, :e] + 0.5 * torch.randn(n, e, generator=g), dim=-1)
    return tuple(v.to(device) for v in (x, y, x2, t))


def loss_and_grad(name: str, options: dict, chunk: int | None, batch, dtype: torch.dtype | None):
    """The objective's loss and its gradient in (image, text) features; under autocast in ``dtype``
    (None: fp32), the backward outside the autocast region as the trainer runs it."""
    x, y, x2 = (v.clone().requires_grad_() for v in batch[:3])
    t = batch[3]
    fn = LOSSES[name](chunk_size=chunk, **options).to(x.device)
    kw = dict(image_features=x, text_features=y, logit_scale=torch.tensor(100.0, device=x.device),
              logit_bias=torch.tensor(-10.0, device=x.device), target_embeddings=t, image_features_2=x2,
              sample_index=torch.arange(x.shape[0], device=x.device))
    with torch.autocast(x.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        out = fn(**kw)[f"{name}_loss"]
    gx, gy = torch.autograd.grad(out, (x, y), allow_unused=True)
    return out.float(), torch.cat([torch.zeros_like(x) if gx is None else gx.float(),
                                   torch.zeros_like(y) if gy is None else gy.float()])


def agreement(name: str, options: dict, chunk: int | None, batch, dtype: torch.dtype) -> dict[str, float]:
    """Relative error of the loss and of the gradient (norm of the difference / norm) against fp32."""
    ref, g_ref = loss_and_grad(name, options, chunk, batch, None)
    out, g = loss_and_grad(name, options, chunk, batch, dtype)
    return {"loss": float(out.detach()), "loss_fp32": float(ref.detach()),
            "loss_rel": float((out.detach() - ref.detach()).abs() / ref.detach().abs()),
            "grad_rel": float((g - g_ref).norm() / g_ref.norm())}
