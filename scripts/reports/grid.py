"""The experiment grid's definition (scripts/reports/experiment.py runs it; evidence.py tables it): the
model, the steps, every variant's config and the tabled metrics."""

from __future__ import annotations

# The grid's model: the packaged 32 px ViT made small enough that a cell's STEPS fit ~60 s on 2 CPU
# cores (measured on the MNIST grid: the training loop takes 52-66 s for 550 steps at batch 64, data
# loading and 5 held-out evaluations included), with a trainable text tower.
MODEL_OVERRIDES = {"embed_dim": 64, "vision_cfg": {"width": 96, "layers": 3, "head_width": 32},
                   "text_cfg": {"width": 64, "layers": 2, "heads": 2}}
# Region weighting's warm-up: Hedge then has STEPS - REGION_WARMUP >= 500 weighted steps to move its weights
REGION_WARMUP = 50
STEPS = 550
# The model reads 32 px (the packaged ViT's size); --input-size N reads N px with patches of N/4 px, the same
# 16 tokens. demo:openmoji-all's shards are 64 px, but a 64-px input measured no better there (3 seeds:
# linear probe 0.396 +- 0.035 vs 0.420 +- 0.024, image R@5 0.118 vs 0.118) at 2.1x the training time
# (bench_results/experiments/input_64px/), so its grid reads 32 px too.
INPUT_SIZE = 32


def regions(space: str, steps: int) -> list[dict]:
    return [{"name": "regions", "options": {"base": "clip", "scales": [5, 10, 20], "space": space, "bank_size": 1024,
                                            "refresh_every": 20, "eta0": 0.1,
                                            "warmup_steps": min(REGION_WARMUP, steps // 5), "warmup_epochs": 0}}]


# The distillation teacher (issue "teacher targets"): a larger tiny model trained TEACHER_STEPS x the
# student's steps on the same training split only, then `data_tools embed --image-model` with K crops
TEACHER_OVERRIDES = {"embed_dim": 96, "vision_cfg": {"width": 128, "layers": 4, "head_width": 32},
                     "text_cfg": {"width": 96, "layers": 3, "heads": 3}}
TEACHER_STEPS = 3
TEACHER_CROPS = 10


# each teacher: the grid cell that trains it, and where its rows go (None: beside the training shards)
TEACHER_CELLS = {"teacher": ("teacher", None), "lit": ("lit", "teacher_lit")}


def distill(clip_weight: float, teacher: str = "teacher") -> dict:
    """clip (when weighted) + distill from one of the grid's teachers at its own learned logit scale."""
    terms = [{"name": "clip", "weight": clip_weight}] if clip_weight else []
    return {"loss": terms + [{"name": "distill", "weight": 1.0, "options": {"teacher_scale": "TEACHER_SCALE"}}],
            "teacher": teacher}


# The image tower's compute per sample against CLIP's, over 0.9 + 0.1 of the steps, from its tokens
# (1 + 16 at 32 px; 1 + 8 at 50 % dropout; 1 + 4 at 16 px): its transformer's cost is linear in them at 17 tokens
COMPUTE = {"flip50": 0.9 * 9 / 17 + 0.1, "lowres": 0.9 * 5 / 17 + 0.1}


def flip(steps: int) -> dict:
    return {"loss": [{"name": "clip"}], "model": {"patch_dropout": 0.5},
            "train": {"steps": steps, "phases": [{"share": 0.9}, {"share": 0.1, "patch_dropout": 0.0}]}}


def lowres(steps: int, rewarm: bool = False) -> dict:
    last = {"share": 0.1, **({"warmup_steps": 10} if rewarm else {})}
    return {"loss": [{"name": "clip"}], "train": {"steps": steps, "phases": [{"share": 0.9, "image_size": 16}, last]}}


# The caption decoder (issue 65): open_clip's CoCa at the grid's widths (mmpt-tiny-coca: an attentional pooler
# whose 16 tokens the 2-block decoder reads), trained with CLIP alone (its decoder frozen: the same towers) and
# with CLIP + 2 x caption (CoCa's weights); captions of at most 16 tokens, decoded by the CLIP tokenizer
COCA = {"arch": "mmpt-tiny-coca", "overrides": {**MODEL_OVERRIDES, "text_cfg": {**MODEL_OVERRIDES["text_cfg"],
                                                                                "context_length": 16},
                                               "multimodal_cfg": {"context_length": 16}}}
CAPTION_VARIANTS = ("coca_clip", "coca_caption")

# SigLIP 2's self-supervised half (issue 66): sigmoid throughout; from 80 % of the steps SILC's self-distillation
# (4 local crops of 16 px: 2 x 2 patches) and TIPS's masked prediction (weight 0.25, half the 16 patches masked)
# against the train.ema average, a copy of the weights up to the start step, then an EMA of decay 0.99 (the
# 110 steps left are ~1 time constant); DINO heads of 256 prototypes. ssl_sigmoid keeps the average too (never
# evaluated: the cells score the trained weights), so the three differ in their loss terms only.
SSL_HEAD = {"out_dim": 256, "hidden_dim": 256, "bottleneck_dim": 64, "start_at": 0.8}


def siglip2(steps: int, distill: bool, masked: bool, start: float = 0.8) -> dict:
    """``start``: the terms' start_at (``ssl_both_from0``: the whole run, the average an EMA from the first step)."""
    head = {**SSL_HEAD, "start_at": start}
    loss = [{"name": "sigmoid"}]
    if distill:
        loss.append({"name": "self_distill", "options": {**head, "local_crops": 4, "local_size": 16}})
    if masked:
        loss.append({"name": "masked_prediction", "weight": 0.25, "options": {**head, "mask_ratio": 0.5}})
    return {"loss": loss, "train": {"ema": {"decay": 0.99, "warmup_steps": int(start * steps)}}}


VARIANTS = {
    "clip": lambda steps: {"loss": [{"name": "clip"}]},
    "sigmoid": lambda steps: {"loss": [{"name": "sigmoid"}]},
    "sigmoid_wvn": lambda steps: {"loss": [{"name": "sigmoid", "options": {"within_view_negatives": True}}]},
    "clip_soft_0.5": lambda steps: {"loss": [{"name": "clip"}, {"name": "soft_target", "weight": 0.5,
                                                                 "options": {"target_temperature": 0.05}}]},
    "clip_soft_1.0": lambda steps: {"loss": [{"name": "clip"}, {"name": "soft_target", "weight": 1.0,
                                                                 "options": {"target_temperature": 0.05}}]},
    "cwcl": lambda steps: {"loss": [{"name": "cwcl"}]},
    "clip_vrn": lambda steps: {"loss": [{"name": "clip"}, {"name": "vrn", "weight": 1.0}]},
    "regions_image": lambda steps: {"loss": regions("image", steps)},
    "regions_target": lambda steps: {"loss": regions("target", steps)},
    # FastCLIP-v3 (issue 24): its CC3M settings, gamma decaying over about half of a b64 grid's epochs
    "global_clip": lambda steps: {"loss": [{"name": "global_clip", "options": {
        "gamma": 0.2, "gamma_schedule": "cosine", "gamma_decay_epochs": 4, "rho": 6.5}}]},
    "teacher": lambda steps: {"loss": [{"name": "clip"}], "model": {"arch": "mmpt-tiny-vit",
                                                                    "overrides": TEACHER_OVERRIDES},
                              "train": {"steps": TEACHER_STEPS * steps}},
    "clip_distill": lambda steps: distill(1.0),
    "distill": lambda steps: distill(0.0),
    # the LiT cell (frozen MiniLM text tower, seed 0, trained on the same split) as the teacher: 3x CLIP's zero-shot
    "clip_distill_lit": lambda steps: distill(1.0, "lit"),
    "distill_lit": lambda steps: distill(0.0, "lit"),
    # ReSA (issue 55): self-assigned targets from the image tower's own encodings, no frozen model; beside
    # CLIP at X-CLR's weight (clip_soft_0.5), online and from the weight average (ReSA's momentum encoder)
    "clip_resa": lambda steps: {"loss": [{"name": "clip"}, {"name": "resa", "weight": 0.5}]},
    "clip_resa_ema": lambda steps: {"loss": [{"name": "clip"}, {"name": "resa", "weight": 0.5,
                                                                 "options": {"encodings": "ema"}}],
                                    "train": {"ema": {"decay": 0.99}}},
    # fewer image tokens (issue 63): FLIP 50 % with an unmasked last tenth, and CLIPA's 16 px (4 patches) for
    # nine tenths then 32 px, at the grid's steps and at its image-tower compute (more steps: see COMPUTE)
    "clip_flip50": lambda steps: flip(steps),
    "clip_flip50_compute": lambda steps: flip(round(steps / COMPUTE["flip50"])),
    "clip_lowres": lambda steps: lowres(steps),
    "clip_lowres_compute": lambda steps: lowres(round(steps / COMPUTE["lowres"])),
    # the same with the 32 px phase's own schedule (10 warm-up steps to optim.lr, cosine), as CLIPA fine-tunes: the
    # run's schedule leaves its last tenth under 3 % of the peak rate to adapt to 16 tokens from 4
    "clip_lowres_rewarm": lambda steps: lowres(steps, rewarm=True),
    "clip_lowres_rewarm_compute": lambda steps: lowres(round(steps / COMPUTE["lowres"]), rewarm=True),
    "coca_clip": lambda steps: {"loss": [{"name": "clip"}], "model": COCA},
    "coca_caption": lambda steps: {"loss": [{"name": "clip"}, {"name": "caption", "weight": 2.0}], "model": COCA},
    "ssl_sigmoid": lambda steps: siglip2(steps, False, False),
    "ssl_self_distill": lambda steps: siglip2(steps, True, False),
    "ssl_both": lambda steps: siglip2(steps, True, True),
    # past 80 % the cosine schedule is under 10 % of its peak rate: the same terms over the whole run
    "ssl_both_from0": lambda steps: siglip2(steps, True, True, start=0.0),
    "lit": lambda steps: {"loss": [{"name": "clip"}],
                          "model": {"arch": "mmpt-tiny-vit-minilm", "lock_text": True, "text_from_targets": True,
                                    "overrides": {k: v for k, v in MODEL_OVERRIDES.items() if k != "text_cfg"}}},
}
# the final evaluation's metrics kept in the JSON (every one the tasks give is kept; these are tabled)
TABLE = ("heldout/acc1", "heldout/lp_acc1", "heldout/knn_acc1", "heldout/ari", "heldout/ari_preproj",
         "digits/acc1", "retrieval/image_retrieval_recall@5", "cross_style/acc1",
         "cross_style_retrieval/image_retrieval_recall@5", "captioning/Bleu_4", "captioning/CIDEr",
         "dense/dense_miou", "dense/dense_patch_acc")
