"""Fewer image tokens: FLOPs per sample (torch.utils.flop_counter), the step's time and the bytes saved
for backward of an image-heavy tiny ViT, unmasked, at P = 0.5 and 0.75 -- ours (model.patch_dropout:
the seeded draw on the host, the kept indices gathered) beside open_clip's PatchDropout on the same tower
-- and at half the resolution (a train.phases low-resolution phase: a quarter of the tokens, CLIPA);
then the same cases' FLOPs counted on ViT-B/16 (the recipes' arithmetic, no timing).

    python scripts/bench/bench_patch_dropout.py                 # 224 px, patch 16 (196 patches), batch 32
    python scripts/bench/bench_patch_dropout.py --repeats 1     # quick look

A step is the image tower's forward and backward and the CLIP loss against fixed text features, fp32, on
this CPU. Writes bench_results/patch_dropout.json: headline ``ratio`` = unmasked step time / ours at P = 0.5
(higher is better; FLIP's halving of the tower's compute would give 2).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from open_clip.transformer import PatchDropout
from torch.utils.flop_counter import FlopCounterMode

from mmpretrain.losses import build_objective
from mmpretrain.models import factory
from mmpretrain.models.patch_dropout import dropping, kept_patches

from benchlib import median, table, write_result


def tower(args, prob: float) -> factory.DualEncoder:
    over = {"embed_dim": 128, "vision_cfg": {"image_size": args.size, "patch_size": 16, "width": args.width,
                                             "layers": args.layers, "head_width": 64}}
    torch.manual_seed(0)
    return factory.build_dual_encoder(factory.resolve_model_cfg("mmpt-tiny-vit", overrides=over), arch="mmpt-tiny-vit",
                                      patch_dropout_prob=prob)


def vit_b16_flops() -> dict[str, float]:
    """FLOPs per sample of open_clip's ViT-B-16 image tower, forward and backward, at 224 px unmasked, at
    P = 0.5 and 0.75, and at 112 px (counted, not timed: a batch of 2)."""
    out = {}
    for name, size, prob in (("224 px", 224, 0.0), ("224 px P=0.5", 224, 0.5), ("224 px P=0.75", 224, 0.75),
                             ("112 px", 112, 0.0)):
        cfg = factory.resolve_model_cfg("ViT-B-16", overrides={"vision_cfg": {"image_size": size}})
        torch.manual_seed(0)
        visual = factory.build_dual_encoder(cfg, arch="ViT-B-16", patch_dropout_prob=prob).clip.visual
        images = torch.randn(2, 3, size, size)
        n = visual.grid_size[0] * visual.grid_size[1]
        keep = kept_patches(torch.arange(2), 0, 0, n, prob) if prob else None
        with FlopCounterMode(display=False) as fc, dropping(visual, keep):
            visual(images).sum().backward()
        out[name] = fc.get_total_flops() / 2
    return out


def step_fn(model, images, text, objective, kind: str, prob: float):
    visual = model.clip.visual
    n = visual.grid_size[0] * visual.grid_size[1]
    if kind == "open_clip":
        visual.patch_dropout = PatchDropout(prob)
    calls = [0]

    def step():
        calls[0] += 1
        keep = kept_patches(torch.arange(len(images)), 0, calls[0], n, prob) if kind == "ours" else None
        with dropping(visual, keep):
            feats = F.normalize(visual(images), dim=-1)
        out = objective(image_features=feats, text_features=text, logit_scale=torch.tensor(14.3))
        out["clip_loss"].backward()
        model.zero_grad(set_to_none=True)

    return step


def saved_bytes(fn) -> int:
    total = [0]

    def pack(t):
        total[0] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--width", type=int, default=192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    images = torch.randn(args.batch, 3, args.size, args.size, generator=g)
    text = F.normalize(torch.randn(args.batch, 128, generator=g), dim=-1)
    objective = build_objective([{"name": "clip"}])
    cases = [("unmasked", "none", 0.0)] + [(f"{k} P={q}", k, q) for q in (0.5, 0.75) for k in ("ours", "open_clip")]
    fns = {name: step_fn(tower(args, q if k == "ours" else 0.0), images, text, objective, k, q) for name, k, q in cases}
    low = argparse.Namespace(**{**vars(args), "size": args.size // 2})  # a low-resolution phase: half the side
    small = F.interpolate(images, size=(low.size, low.size), mode="bilinear", antialias=True)
    fns[f"{low.size} px"] = step_fn(tower(low, 0.0), small, text, objective, "none", 0.0)
    flops, mem = {}, {}
    for name, fn in fns.items():
        fn()  # warm
        with FlopCounterMode(display=False) as fc:
            fn()
        flops[name] = fc.get_total_flops() / args.batch
        mem[name] = saved_bytes(fn)
    times = {name: [] for name in fns}
    for _ in range(args.repeats):  # interleaved, so drift on the machine hits every case
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    base = median(times["unmasked"])
    rows = [(name, f"{flops[name] / 1e9:.2f}", f"{flops['unmasked'] / flops[name]:.2f}", f"{median(times[name]) * 1e3:.0f}",
             f"{base / median(times[name]):.2f}", f"{mem[name] / 2**20:.0f}") for name in fns]
    print(table(rows, ("case", "GFLOP/sample", "FLOP ratio", "step ms", "time ratio", "saved MiB")))
    b16 = vit_b16_flops()
    print("\nViT-B/16 image tower, forward and backward (the recipes' arithmetic):")
    print(table([(k, f"{v / 1e9:.1f}", f"{b16['224 px'] / v:.2f}") for k, v in b16.items()],
                ("case", "GFLOP/sample", "FLOP ratio")))
    ours = [u / o for u, o in zip(times["unmasked"], times["ours P=0.5"])]
    extra = {"batch": args.batch, "image_size": args.size, "width": args.width, "layers": args.layers,
             "threads": torch.get_num_threads(), "flops_per_sample": flops, "saved_bytes": mem,
             "seconds": times, "vit_b16_flops_per_sample": b16}
    path = write_result("patch_dropout", median(ours), True, 1.8, ours, extra)
    print(f"ratio {median(ours):.3f} (unmasked / ours at P=0.5) -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
