"""GPU bench (run by scripts/bench_gpu.sh on a lent GPU machine): training-step throughput and
model-FLOP utilisation of ViT-B-16 in bf16, our step against open_clip_train's, and the tiled loss's
memory at B = 65,536 against open_clip's ClipLoss. Synthetic data (random images and tokens on the
device): the machine has no network and the point is the step, not the loader.

    python scripts/gpu_bench.py --out DIR [--model ViT-B-16] [--batch-size 256] [--steps 30]
                                [--loss-batch 65536] [--device cuda] [--peak-tflops 989]

Steps compared (same model, batch, bf16 autocast, AdamW settings):
  open_clip_train: its ``train_one_epoch`` body -- ``open_clip.loss.ClipLoss``, ``torch.optim.AdamW``
                   with torch's default kernel, logit-scale clamp;
  ours:            ``mmpretrain.grad_cache.forward_backward`` with ``LOSSES["clip"]``, fused AdamW,
                   the same clamp (what ``mmpretrain.train.train_step`` runs).
MFU = model FLOPs per step (counted by torch.utils.flop_counter on one step, forward + backward) x
steps/s / --peak-tflops (H100/H200 dense bf16: 989). Loss memory: peak CUDA memory of one forward +
backward of the loss alone on random unit features (D = 512), minus the inputs.
Writes DIR/gpu.json. ``--device cpu`` with a tiny model runs the same code (a test does).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_fns(model_name: str, batch: int, device, pretrained_cfg_dir: Path | None, bf16: bool = True):
    import open_clip
    import torch
    from open_clip.loss import ClipLoss as OpenClipLoss

    from mmpretrain.grad_cache import forward_backward
    from mmpretrain.losses import LOSSES

    if pretrained_cfg_dir is not None:
        open_clip.add_model_config(pretrained_cfg_dir)
    cfg = open_clip.get_model_config(model_name)
    size = cfg["vision_cfg"]["image_size"]
    ctx = cfg["text_cfg"].get("context_length", 77)
    vocab = cfg["text_cfg"].get("vocab_size", 49408)
    g = torch.Generator(device="cpu").manual_seed(0)
    images = torch.randn(batch, 3, size, size, generator=g).to(device)
    tokens = torch.randint(1, vocab, (batch, ctx), generator=g).to(device)
    from contextlib import nullcontext

    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 else nullcontext

    def build(fused: bool):
        torch.manual_seed(0)
        model = open_clip.create_model(model_name, device=device, output_dict=True)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.1,
                                fused=True if fused else None)
        return model, opt

    model_a, opt_a = build(False)
    loss_a = OpenClipLoss()

    def theirs():
        opt_a.zero_grad()
        with autocast():
            out = model_a(images, tokens)
            total = loss_a(out["image_features"], out["text_features"], out["logit_scale"])
        total.backward()
        opt_a.step()
        with torch.no_grad():
            model_a.logit_scale.clamp_(0, math.log(100))

    model_b, opt_b = build(True)
    loss_b = LOSSES["clip"]()

    class Acc:  # the accelerator surface forward_backward uses, without a process group
        @staticmethod
        def autocast():
            return autocast()

        @staticmethod
        def backward(x):
            x.backward()

        @staticmethod
        def unwrap_model(m):
            return m

    class Towers(torch.nn.Module):  # mmpretrain's DualEncoder call signature
        def __init__(self, clip):
            super().__init__()
            self.clip = clip

        def forward(self, images, tokens=None, target_embeddings=None):
            out = self.clip(images, tokens)
            return {"image_features": out["image_features"], "text_features": out["text_features"],
                    "logit_scale": out["logit_scale"]}

    towers = Towers(model_b)

    def ours():
        forward_backward(Acc, towers, loss_b, images, tokens)
        opt_b.step()
        opt_b.zero_grad(set_to_none=True)
        with torch.no_grad():
            model_b.logit_scale.clamp_(0, math.log(100))

    def flops() -> int:
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:
            with autocast():
                out = model_a(images, tokens)
                total = loss_a(out["image_features"], out["text_features"], out["logit_scale"])
            total.backward()
        opt_a.zero_grad()
        return counter.get_total_flops()

    return theirs, ours, flops


def time_steps(fn, steps: int, device) -> float:
    for _ in range(3):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / steps


def loss_memory(batch: int, device, dim: int = 512, chunk: int = 4096) -> dict:
    import torch
    import torch.nn.functional as F
    from open_clip.loss import ClipLoss as OpenClipLoss

    from mmpretrain.losses import LOSSES

    res = {}
    for name, fn in (("ours_tiled", lambda x, y, s: LOSSES["clip"](chunk_size=chunk)(
                         image_features=x, text_features=y, logit_scale=s)["clip_loss"]),
                     ("open_clip", lambda x, y, s: OpenClipLoss()(x, y, s))):
        x = F.normalize(torch.randn(batch, dim, device=device), dim=-1).requires_grad_()
        y = F.normalize(torch.randn(batch, dim, device=device), dim=-1).requires_grad_()
        s = torch.tensor(14.3, device=device)
        try:
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            t0 = time.perf_counter()
            fn(x, y, s).backward()
            sync(device)
            dt = time.perf_counter() - t0
            peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
            res[name] = {"peak_bytes_above_inputs": peak, "seconds": round(dt, 4)}
        except torch.OutOfMemoryError as e:
            res[name] = {"error": f"out of memory: {str(e)[:200]}"}
        del x, y
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="ViT-B-16")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--loss-batch", type=int, default=65536)
    p.add_argument("--device", default="cuda")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the device")
    p.add_argument("--model-config-dir", default=None, help="extra open_clip model configs (the tiny CPU smoke run)")
    args = p.parse_args()
    import torch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device (use --device cpu for a smoke run)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    theirs, ours, flops = step_fns(args.model, args.batch_size, device,
                                   Path(args.model_config_dir) if args.model_config_dir else None,
                                   bf16=args.precision == "bf16")
    step_flops = flops()
    runs = []
    for r in range(args.repeats):
        pair = {}
        for name, fn in (("open_clip_train", theirs), ("ours", ours)) if r % 2 == 0 else (("ours", ours), ("open_clip_train", theirs)):
            pair[name] = time_steps(fn, args.steps, device)
        runs.append(pair)
        print(f"repeat {r + 1}: " + ", ".join(f"{k} {args.batch_size / v:.0f} samples/s" for k, v in pair.items()),
              flush=True)
    med = {k: sorted(p[k] for p in runs)[len(runs) // 2] for k in ("open_clip_train", "ours")}
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": args.model, "batch_size": args.batch_size, "precision": args.precision,
        "flops_per_step": step_flops,
        "samples_per_s": {k: round(args.batch_size / v, 1) for k, v in med.items()},
        "mfu": {k: round(step_flops / v / (args.peak_tflops * 1e12), 4) for k, v in med.items()},
        "ratio": round(med["open_clip_train"] / med["ours"], 4),
        "runs": [round(p["open_clip_train"] / p["ours"], 4) for p in runs],
        "loss_memory": {"batch": args.loss_batch, **loss_memory(args.loss_batch, device)},
        "torch": torch.__version__,
    }
    (out / "gpu.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
