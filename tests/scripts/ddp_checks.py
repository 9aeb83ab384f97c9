"""Run under ``accelerate launch`` with 2 CPU processes (DDP over gloo) by the session fixture
``ddp_checks`` (tests/conftest.py), once for every test that reads its report (tests/test_ddp.py,
tests/test_train.py), on the real shards given as argv[1]; argv[4] picks the checks, comma-separated
(``unused``, ``masks``, ``steps``); the main process writes a JSON report to argv[3].

- ``unused``, ``unused_<case>``: an objective that leaves a model parameter unused -- vrn alone and align_uniform
  alone (no logit scale), clip on an architecture that owns a logit bias -- trains 3 steps (DDP stops
  at step 2 when a parameter it registered gets no gradient).
- ``masks``, ``masks_differ``: with patch dropout, the same images on both ranks draw different masks right
  after setup (each rank its own seed), while the initial weights are the same on both.
- ``steps``: tests/scripts/step_equivalence.py's float64 steps with the global batch split over the 2
  ranks (its ``default`` set), under ``steps`` in the report.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from accelerate.utils import gather_object

ROOT = Path(__file__).resolve().parents[2]
CASES = {"vrn": ["loss=[{name: vrn}]"], "align_uniform": ["loss=[{name: align_uniform}]"],
         "clip_with_bias": ["loss=[{name: clip}]", "model.overrides={init_logit_bias: -10.0}"]}


def config(data: str, run_dir: Path, *extra: str):
    from mmpretrain.config import load_config

    return load_config(ROOT / "configs/demo.yaml", [
        f"data.train={data}", f"run_dir={run_dir}", "train.steps=3", "train.epochs=null", "data.batch_size=8",
        "data.num_workers=0", "data.shuffle_buffer=0", "optim.warmup_steps=1", "train.log_every=1",
        "train.progress=false", "train.log_with=[]", *extra])


def main(data: str, out_dir: str, report_path: str, checks: str) -> None:
    from accelerate import PartialState

    from mmpretrain.train import fit, setup

    report, wanted = {}, checks.split(",")
    for name, extra in CASES.items() if "unused" in wanted else ():
        run = setup(config(data, Path(out_dir) / name, *extra))
        try:
            fit(run)
            report[f"unused_{name}"] = "ok"
        except RuntimeError as e:  # DDP's unused-parameter error: the next collective would hang, stop here
            report[f"unused_{name}"] = str(e).splitlines()[0][:300]
            wanted = []
            break
    if "masks" in wanted:
        run = setup(config(data, Path(out_dir) / "masks", "model.overrides={vision_cfg: {patch_dropout: 0.5}}"))
        clip = run.accelerator.unwrap_model(run.model).clip
        weights = float(sum(p.detach().double().sum() for p in clip.visual.parameters()))
        images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
        clip.train()
        with torch.no_grad():
            feats = clip.encode_image(images)
        w_all, f_all = gather_object([weights]), gather_object([feats])
        report["same_initial_weights"] = w_all[0] == w_all[1]
        report["masks_differ"] = not torch.equal(f_all[0], f_all[1])
    if "steps" in wanted:
        from step_equivalence import main as steps  # this script's folder is on sys.path

        report["steps"] = steps(None, "default")
    if PartialState().is_main_process:
        Path(report_path).write_text(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:5])
