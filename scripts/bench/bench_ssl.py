"""SigLIP 2's self-supervised terms' step cost: a training step (forward, backward) of sigmoid alone against
sigmoid + self_distill and sigmoid + self_distill + masked_prediction past their start (the student's local
crops and masked view, the teacher's forward under the weight average, the heads), on the evidence grid's tiny
model and the same batch, beside open_clip's sigmoid step (``SigLipLoss``; open_clip has neither term); the
FLOPs of the three steps counted on ViT-B-16 at 224 px with the CC3M recipe's settings (no timing); and the
loader's per-sample cost of cutting the local crops from photo-like JPEGs at 224 px.

    python scripts/bench/bench_ssl.py                  # batch 64, 3 repeats
    python scripts/bench/bench_ssl.py --repeats 1      # quick look

fp32 on this CPU. Writes bench_results/ssl.json: headline ``ratio`` = the sigmoid + both step's time / the
sigmoid step's (lower is better), with the self_distill ratio, the counted FLOPs and the loader's figures.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from open_clip.loss import SigLipLoss
from torch.utils.flop_counter import FlopCounterMode

from mmpretrain.data.crop import ResizedCrop
from mmpretrain.data.decode import SampleDecoder
from mmpretrain.losses import build_objective, total_of
from mmpretrain.models import factory
from mmpretrain.models.patch_dropout import num_patches
from mmpretrain.models.ssl import SelfSupervised, SslInputs, Teacher, masked_patches
from mmpretrain.testing.photos import make_jpegs
from mmpretrain.train.ema import EMA

from benchlib import interleaved, median, table, write_result

# the evidence grid's model and SSL terms (scripts/reports/grid.py MODEL_OVERRIDES, SSL_HEAD, siglip2)
TINY = {"embed_dim": 64, "vision_cfg": {"width": 96, "layers": 3, "head_width": 32},
        "text_cfg": {"width": 64, "layers": 2, "heads": 2}}
TINY_SSL = {"out_dim": 256, "hidden_dim": 256, "bottleneck_dim": 64, "start_at": 0}
# the CC3M recipe's (configs/cc3m_siglip2_vitb16.yaml)
B16_SSL = {"out_dim": 8192, "hidden_dim": 2048, "bottleneck_dim": 256, "start_at": 0}


def terms(ssl: dict, local: int, size: int) -> dict[str, list[dict]]:
    sd = {"name": "self_distill", "options": {**ssl, "local_crops": local, "local_size": size}}
    mp = {"name": "masked_prediction", "weight": 0.25, "options": {**ssl, "mask_ratio": 0.5}}
    return {"sigmoid": [{"name": "sigmoid"}], "sigmoid + self_distill": [{"name": "sigmoid"}, sd],
            "sigmoid + both": [{"name": "sigmoid"}, sd, mp]}


def steps(arch: str, overrides: dict | None, ssl: dict, local: int, local_size: int, batch: int):
    """Each step a zero-argument function: one forward and backward on the same batch, as train_step runs it
    (the teacher's outputs under the average through EMA.call, then the student's forward and the loss)."""
    torch.manual_seed(0)
    cfg = factory.resolve_model_cfg(arch, overrides=overrides)
    # sigmoid's initial scale and bias (the objective's declared ones), so the model has its bias
    clip = factory.instantiate(factory.with_logit_init(cfg, math.log(10), -10.0), load_text_weights=False)
    model = factory.DualEncoder(clip)
    size = clip.visual.image_size[0] if isinstance(clip.visual.image_size, tuple) else clip.visual.image_size
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(batch, 3, size, size, generator=gen)
    crops = torch.randn(batch * local, 3, local_size, local_size, generator=gen)
    tokens = torch.randint(1, 49406, (batch, cfg["text_cfg"].get("context_length", 77)), generator=gen)
    index = torch.arange(batch)
    objectives = {k: build_objective(v) for k, v in terms(ssl, local, local_size).items()}
    full = objectives["sigmoid + both"].for_tower(num_patches(clip.visual))
    model.ssl = SelfSupervised(clip.visual, full.ssl_heads)
    ema = EMA(model, 0.99)
    masked = masked_patches(index, 0, 1, full.terms[2].num_patches, full.terms[2].masked_count())
    siglip = SigLipLoss()

    def run(objective, with_local: bool, with_mask: bool):
        def step():
            model.zero_grad(set_to_none=True)
            ssl_in, context = None, {}
            if with_local or with_mask:
                context = ema.call(Teacher(model), images, with_local, masked if with_mask else None)
                ssl_in = SslInputs(crops if with_local else None, local, masked if with_mask else None)
            out = model(images, tokens=tokens, ssl=ssl_in)
            total_of(objective(**out, **context, step=1)).backward()
        return step

    def oc_sigmoid():
        model.zero_grad(set_to_none=True)
        siglip(clip.encode_image(images, normalize=True), clip.encode_text(tokens, normalize=True),
               clip.logit_scale.exp(), clip.logit_bias).backward()

    return {"open_clip sigmoid (SigLipLoss)": oc_sigmoid,
            "ours sigmoid": run(objectives["sigmoid"], False, False),
            "ours sigmoid + self_distill": run(objectives["sigmoid + self_distill"], True, False),
            "ours sigmoid + both": run(objectives["sigmoid + both"], True, True)}


def flops(step) -> float:
    with FlopCounterMode(display=False) as fc:
        step()
    return fc.get_total_flops()


def loader_cost(n: int, repeats: int) -> dict:
    """ms per sample of the loader's decode: open_clip's 224 px crop alone, and with 8 local crops of 96 px
    (the recipe's), on photo-like JPEGs (shorter side 256-512 px)."""
    from mmpretrain.losses.self_supervised import LocalCrops

    samples = [{"__key__": k, "jpg": data, "txt": b"a photo"} for k, data in make_jpegs(n)]
    plain = SampleDecoder(ResizedCrop(224, (0.9, 1.0)), embeddings="ignore")
    local = SampleDecoder(ResizedCrop(224, (0.9, 1.0)), embeddings="ignore", local_crops=LocalCrops(8, 96, (0.05, 0.4)))
    out = {}
    for name, dec in (("global crop", plain), ("global crop + 8 local crops", local)):
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for s in samples:
                dec(s, 0, 0)
            runs.append(1e3 * (time.perf_counter() - t0) / n)
        out[name] = runs
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--iters", type=int, default=10, help="timed steps per repeat (after 2 warm-up steps)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--images", type=int, default=200, help="photo JPEGs for the loader's cost")
    args = p.parse_args()

    fns = steps("mmpt-tiny-vit", TINY, TINY_SSL, 4, 16, args.batch)
    times = interleaved(fns, args.repeats, args.iters)
    med = {k: median(v) for k, v in times.items()}
    both_runs = [b / s for b, s in zip(times["ours sigmoid + both"], times["ours sigmoid"])]
    sd_runs = [b / s for b, s in zip(times["ours sigmoid + self_distill"], times["ours sigmoid"])]
    ratio = median(both_runs)

    big = steps("ViT-B-16", None, B16_SSL, 8, 96, 2)  # the recipe's model and terms, counted (batch 2)
    counted = {k.removeprefix("ours "): flops(v) / 2 for k, v in big.items() if k.startswith("ours")}
    loader = loader_cost(args.images, args.repeats)
    lmed = {k: median(v) for k, v in loader.items()}

    rows = [(k, f"{1e3 * med[k]:.1f}", f"{1e3 * min(v):.1f}-{1e3 * max(v):.1f}", f"{args.batch / med[k]:.0f}")
            for k, v in times.items()]
    print(table(rows, (f"step (grid's tiny ViT, batch {args.batch}, fp32, this CPU)", "ms/step", "spread",
                       "samples/s")))
    print(f"\nover ours sigmoid: + self_distill {median(sd_runs):.2f}x (runs {', '.join(f'{r:.2f}' for r in sd_runs)}), "
          f"+ both {ratio:.2f}x (runs {', '.join(f'{r:.2f}' for r in both_runs)}); ours sigmoid / open_clip's: "
          f"{med['ours sigmoid'] / med['open_clip sigmoid (SigLipLoss)']:.3f}x")
    print()
    base = counted["sigmoid"]
    print(table([(k, f"{v / 1e9:.1f}", f"{v / base:.2f}x") for k, v in counted.items()],
                ("ViT-B-16 step counted (forward + backward, per sample)", "GFLOP", "over sigmoid")))
    print()
    print(table([(k, f"{v:.2f}") for k, v in lmed.items()], ("loader decode, photo JPEGs (one process)", "ms/sample")))
    path = write_result("ssl", ratio, False, None, both_runs, {
        "ms_per_step": {k: round(1e3 * v, 2) for k, v in med.items()},
        "ms_runs": {k: [round(1e3 * x, 2) for x in v] for k, v in times.items()},
        "self_distill_ratio": round(median(sd_runs), 4), "self_distill_runs": [round(r, 4) for r in sd_runs],
        "ours_over_open_clip_sigmoid": round(med["ours sigmoid"] / med["open_clip sigmoid (SigLipLoss)"], 4),
        "vit_b16_gflop_per_sample": {k: round(v / 1e9, 2) for k, v in counted.items()},
        "vit_b16_flop_ratio": {k: round(v / base, 4) for k, v in counted.items()},
        "loader_ms_per_sample": {k: round(v, 3) for k, v in lmed.items()},
        "loader_ms_runs": {k: [round(x, 3) for x in v] for k, v in loader.items()},
        "batch": args.batch, "tiny_overrides": TINY, "tiny_ssl": TINY_SSL, "b16_ssl": B16_SSL})
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
