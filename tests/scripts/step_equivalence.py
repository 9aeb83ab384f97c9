"""Run training steps (mmpretrain.train.train_step) in float64 on fixed in-memory data whose global
batch is split across the launched processes; write the mean losses and a weight checksum to argv[1].
tests/test_train.py runs it in its own process (1 rank), under ``accelerate launch`` with 4 CPU processes
(make test-slow), and through tests/scripts/ddp_checks.py's launch with 2.

argv[2] ``all``: besides clip + soft_target (5 steps), every objective alone (3 steps each; global_clip's
per-sample estimates carried from step to step), with and without gradient caching: the model's parameters, logit scale and bias included, must follow the
one-process run."""

from __future__ import annotations

import json
import sys

import torch

OBJECTIVES = {
    "clip+soft_target": "[{name: clip}, {name: soft_target, weight: 0.5}]",
    "clip_local": "[{name: clip, options: {local_loss: true}}]",
    "clip_no_grad_gather": "[{name: clip, options: {gather_with_grad: false}}]",
    "clip_tiled": "[{name: clip, options: {chunk_size: 4}}]",
    "sigmoid": "[{name: sigmoid}]",
    "sigmoid_within_view": "[{name: sigmoid, options: {within_view_negatives: true}}]",
    "soft_target_image_image": "[{name: clip}, {name: soft_target, options: {space: image_image}}]",
    "cwcl": "[{name: cwcl}]",
    "vrn": "[{name: clip}, {name: vrn, weight: 0.5}]",
    "align_uniform": "[{name: align_uniform}]",
    "global_clip": "[{name: global_clip, options: {gamma: 0.5, gamma_schedule: constant}}]",
}


def main(out_path: str | None, which: str = "default") -> dict:
    from accelerate import Accelerator

    from mmpretrain.config import load_config
    from mmpretrain.data.batch import Batch
    from mmpretrain.losses import build_objective
    from mmpretrain.models.factory import build_dual_encoder, resolve_model_cfg
    from mmpretrain.train import Run, TrainState, train_step
    from mmpretrain.train.schedule import Schedule, param_groups

    acc = Accelerator(cpu=True)
    rank, world = acc.process_index, acc.num_processes
    G, steps = 16, 5
    g = torch.Generator().manual_seed(1)
    images = torch.randn(steps, G, 3, 32, 32, generator=g, dtype=torch.float64)
    tokens = torch.randint(1, 1000, (steps, G, 32), generator=g)
    targets = torch.nn.functional.normalize(torch.randn(steps, G, 24, generator=g, dtype=torch.float64), dim=-1)
    results = {}
    runs = [(mode, "clip+soft_target", 5) for mode in ("whole", "grad_cache")]
    if which == "all":
        runs += [(mode, obj, 3) for obj in list(OBJECTIVES)[1:] for mode in ("whole", "grad_cache")]
    for mode, objective_name, n_steps in runs:
        extra = [] if mode == "whole" else ["train.micro_batch_size=4" if G // world > 4 else "train.micro_batch_size=2"]
        cfg = load_config(None, ["data.train=x", f"data.batch_size={G // world}", "train.steps=5", "train.epochs=null",
                                 "optim.warmup_steps=1", "optim.lr=1e-3", "optim.grad_clip_norm=1.0",
                                 f"loss={OBJECTIVES[objective_name]}", *extra])
        torch.manual_seed(0)
        # no dropout or patch dropout: the towers are deterministic, so the per-rank random streams
        # (each rank its own masks, tests/test_ddp.py) cannot make 2 processes differ from 1 here
        # 64 wide and a 1,000-token vocabulary (the tokens drawn above): float64 AdamW over the packaged
        # 256-wide towers and 49,408-token embedding was most of a step's time
        model_cfg = resolve_model_cfg("mmpt-tiny-vit", None, {
            "embed_dim": 64, "vision_cfg": {"layers": 2, "width": 64, "head_width": 32, "patch_dropout": 0.0},
            "text_cfg": {"layers": 2, "width": 64, "heads": 2, "vocab_size": 1000}})
        objective = build_objective([t.model_dump() for t in cfg.loss], rank=rank, world_size=world,
                                    dataset_size=1000, index_size=1000)
        # as the trainer's build_model: the objective's initial scale and bias, unused ones frozen
        model = build_dual_encoder(model_cfg, lock_text=False, text_from_targets=False,
                                   init_logit_scale=objective.init_logit_scale,
                                   init_logit_bias=objective.init_logit_bias).double()
        if not objective.uses_logit_scale:
            model.clip.logit_scale.requires_grad_(False)
        if model.clip.logit_bias is not None and not objective.uses_logit_bias:
            model.clip.logit_bias.requires_grad_(False)
        opt = torch.optim.AdamW(param_groups(model, cfg.optim.weight_decay), lr=cfg.optim.lr)
        model, opt = acc.prepare(model, opt)
        schedule = Schedule(total_steps=5, warmup_steps=1, steps_per_epoch=5, num_samples=1000, global_batch_size=G,
                            world_size=world, diagnostics_every=None)
        run = Run(cfg, acc, model, objective, opt, None, schedule, None, TrainState(position=None))
        model.train()
        losses = []
        for step in range(n_steps):
            rows = slice(rank * G // world, (rank + 1) * G // world)
            # the same G samples every step, one epoch each: global_clip's estimates carry over (γ < 1)
            out = train_step(run, Batch(images=images[step, rows], tokens=tokens[step, rows],
                                        target_embeddings=targets[step, rows], epoch=step,
                                        sample_index=torch.arange(G)[rows]))
            run.state.step += 1
            losses.append(acc.reduce(out.loss.reshape(1).double(), reduction="mean").item())
        w = acc.unwrap_model(model)
        name = mode if objective_name == "clip+soft_target" else f"{mode}/{objective_name}"
        results[name] = {"losses": losses,
                         "weights": float(sum(p.detach().double().abs().sum() for p in w.parameters()))}
        del run, model, opt, w
        acc.free_memory()  # the accelerator keeps every prepared model and optimizer otherwise (~1 GB per run on 4 ranks)
    if acc.is_main_process and out_path:
        with open(out_path, "w") as f:
            json.dump(results, f)
    return results


if __name__ == "__main__":
    main(*sys.argv[1:])
