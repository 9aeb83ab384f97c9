"""The caption decoder's step cost: a training step (forward, backward) of open_clip's CoCa trained with CLIP alone
against CLIP + 2 x caption, ours (``DualEncoder`` + the objectives) beside open_clip's own (``CoCa.forward`` +
``ClipLoss`` / ``CoCaLoss``) on the same model and batch; then the FLOPs of both steps counted on
coca_ViT-B-32 (the CC3M recipe's model, no timing) against ViT-B-32's CLIP step.

    python scripts/bench/bench_caption.py                  # the evidence grid's tiny CoCa, batch 64, 16 tokens
    python scripts/bench/bench_caption.py --repeats 1      # quick look

fp32 on this CPU. Writes bench_results/caption.json: headline ``ratio`` = our CLIP + caption step time / our
CLIP step time (the decoder's cost, lower is better), with open_clip's ratio and ours / open_clip's per step.
"""

from __future__ import annotations

import argparse

import torch
from open_clip.loss import ClipLoss, CoCaLoss
from torch.utils.flop_counter import FlopCounterMode

from mmpretrain.losses import build_objective, total_of
from mmpretrain.models import factory

from benchlib import interleaved, median, table, write_result

# the evidence grid's CoCa (scripts/reports/grid.py COCA): mmpt-tiny-coca at the grid's widths, 16-token captions
TINY = {"embed_dim": 64, "vision_cfg": {"width": 96, "layers": 3, "head_width": 32},
        "text_cfg": {"width": 64, "layers": 2, "heads": 2, "context_length": 16},
        "multimodal_cfg": {"context_length": 16}}


def build(arch: str, overrides: dict | None = None):
    torch.manual_seed(0)
    cfg = factory.resolve_model_cfg(arch, overrides=overrides)
    return factory.instantiate(cfg, load_text_weights=False), cfg


def steps(coca, batch: int, context: int):
    """The four steps, each a zero-argument function doing one forward and backward on the same batch."""
    gen = torch.Generator().manual_seed(0)
    size = coca.visual.image_size[0] if isinstance(coca.visual.image_size, tuple) else coca.visual.image_size
    images = torch.randn(batch, 3, size, size, generator=gen)
    tokens = torch.randint(1, 49406, (batch, context), generator=gen)
    tokens[:, 0], tokens[:, context // 2:] = 49406, 0  # start, a caption of half the context, padding
    tokens[:, context // 2 - 1] = 49407
    ours = factory.DualEncoder(coca)
    clip_only, both = build_objective([{"name": "clip"}]), build_objective([{"name": "clip"}, {"name": "caption",
                                                                                                "weight": 2.0}])
    clip_loss, coca_loss = ClipLoss(), CoCaLoss(caption_loss_weight=2.0, clip_loss_weight=1.0)

    def run(fn):
        def step():
            coca.zero_grad(set_to_none=True)
            fn().backward()
        return step

    def oc_clip():
        return clip_loss(coca.encode_image(images, normalize=True), coca.encode_text(tokens, normalize=True),
                         coca.logit_scale.exp())

    def oc_caption():
        r = coca(images, tokens)
        return sum(coca_loss(r["image_features"], r["text_features"], r["logits"], r["labels"], r["logit_scale"]))

    return {
        "open_clip CLIP": run(oc_clip),
        "open_clip CLIP + caption": run(oc_caption),
        "ours CLIP": run(lambda: total_of(clip_only(**ours(images, tokens=tokens)))),
        "ours CLIP + caption": run(lambda: total_of(both(**ours(images, tokens=tokens, caption=True)))),
    }


def flops(step) -> float:
    with FlopCounterMode(display=False) as fc:
        step()
    return fc.get_total_flops()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--iters", type=int, default=10, help="timed steps per repeat (after 2 warm-up steps)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    coca, cfg = build("mmpt-tiny-coca", TINY)
    fns = steps(coca, args.batch, cfg["text_cfg"]["context_length"])
    times = interleaved(fns, args.repeats, args.iters)
    med = {k: median(v) for k, v in times.items()}
    ratio_runs = [c / p for c, p in zip(times["ours CLIP + caption"], times["ours CLIP"])]
    ratio = median(ratio_runs)
    oc_ratio = med["open_clip CLIP + caption"] / med["open_clip CLIP"]

    # the recipe's model, counted (batch 2): coca_ViT-B-32's two steps and ViT-B-32's CLIP step
    big, big_cfg = build("coca_ViT-B-32")
    big_fns = steps(big, 2, big_cfg["text_cfg"]["context_length"])
    b32, _ = build("ViT-B-32")
    gen = torch.Generator().manual_seed(0)
    im, tok = torch.randn(2, 3, 224, 224, generator=gen), torch.randint(1, 49406, (2, 77), generator=gen)
    b32_step = lambda: ClipLoss()(b32.encode_image(im, normalize=True), b32.encode_text(tok, normalize=True),  # noqa: E731
                                  b32.logit_scale.exp()).backward()
    counted = {"coca_ViT-B-32 CLIP": flops(big_fns["ours CLIP"]) / 2,
               "coca_ViT-B-32 CLIP + caption": flops(big_fns["ours CLIP + caption"]) / 2,
               "ViT-B-32 CLIP": flops(b32_step) / 2}

    rows = [(k, f"{1e3 * med[k]:.1f}", f"{1e3 * min(v):.1f}-{1e3 * max(v):.1f}", f"{args.batch / med[k]:.0f}")
            for k, v in times.items()]
    print(table(rows, ("step (tiny CoCa, fp32, this CPU)", "ms/step", "spread", "samples/s")))
    print(f"\nCLIP + caption / CLIP: ours {ratio:.2f}x (runs {', '.join(f'{r:.2f}' for r in ratio_runs)}), "
          f"open_clip {oc_ratio:.2f}x; ours / open_clip: CLIP {med['ours CLIP'] / med['open_clip CLIP']:.3f}x, "
          f"CLIP + caption {med['ours CLIP + caption'] / med['open_clip CLIP + caption']:.3f}x")
    print()
    print(table([(k, f"{v / 1e9:.1f}") for k, v in counted.items()],
                ("step counted (forward + backward, per sample)", "GFLOP")))
    cap = counted["coca_ViT-B-32 CLIP + caption"]
    print(f"\ncoca_ViT-B-32 CLIP + caption / its CLIP step: {cap / counted['coca_ViT-B-32 CLIP']:.2f}x; "
          f"/ ViT-B-32's CLIP step: {cap / counted['ViT-B-32 CLIP']:.2f}x")
    path = write_result("caption", ratio, False, None, ratio_runs, {
        "ms_per_step": {k: round(1e3 * v, 2) for k, v in med.items()},
        "ms_runs": {k: [round(1e3 * x, 2) for x in v] for k, v in times.items()},
        "open_clip_ratio": round(oc_ratio, 4),
        "ours_over_open_clip": {"clip": round(med["ours CLIP"] / med["open_clip CLIP"], 4),
                                "caption": round(med["ours CLIP + caption"] / med["open_clip CLIP + caption"], 4)},
        "gflop_per_sample": {k: round(v / 1e9, 2) for k, v in counted.items()},
        "batch": args.batch, "tiny_overrides": TINY})
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
