"""Every shipped recipe fits: at its own global batch no objective builds a batch-by-batch fp32 matrix
over 1 GiB per rank, counted by the objectives' declared :meth:`largest_matrix`, which is held here to a
trace of each objective's forward and backward (every float matrix made, the gathers replaced by copies
of the rank's batch so that shapes are the real run's)."""

from __future__ import annotations

import re

import pytest
import yaml

from mmpretrain.config.load import load_config
from mmpretrain.losses import LOSSES, build_objective
from mmpretrain.models import factory
from mmpretrain.models.caption import decoder_shape, is_coca
from mmpretrain.testing.largest_matrix import traced_peak
from tests.conftest import ROOT

GIB = 2**30

# (objective, options): every objective, each form that changes its matrices
CASES = [
    ("clip", {}), ("clip", {"local_loss": True}), ("clip", {"gather_with_grad": False}), ("clip", {"chunk_size": 5}),
    ("clip", {"local_loss": True, "chunk_size": 5}), ("clip", {"hard_negatives": True}),
    ("clip", {"hard_negatives": True, "chunk_size": 5}), ("clip", {"hard_negatives": True, "local_loss": True}),
    ("sigmoid", {"hard_negatives": True}), ("resa", {}), ("resa", {"chunk_size": 5}),
    ("sigmoid", {}), ("sigmoid", {"chunk_size": 5}), ("sigmoid", {"within_view_negatives": True}),
    ("soft_target", {}), ("soft_target", {"chunk_size": 5}), ("soft_target", {"space": "image_image"}),
    ("cwcl", {}), ("caption", {}), ("caption", {"pad_id": 3}), ("distill", {}), ("distill", {"chunk_size": 5}), ("global_clip", {}), ("align_uniform", {}), ("vrn", {}),
    ("self_distill", {"out_dim": 61}), ("self_distill", {"out_dim": 61, "local_crops": 2}),
    ("masked_prediction", {"out_dim": 61}), ("masked_prediction", {"out_dim": 61, "mask_ratio": 0.25}),
    ("regions", {"base": "clip", "scales": [2, 3], "bank_size": 24, "refresh_every": 1}),
    ("regions", {"base": "soft_target", "scales": [2], "bank_size": 24, "refresh_every": 1}),
]


def test_the_cases_cover_every_objective():
    assert {name for name, _ in CASES} == set(LOSSES)


@pytest.mark.parametrize("batch,world_size", [(8, 1), (12, 3)])
@pytest.mark.parametrize("name,options", CASES, ids=[f"{n}-{'-'.join(o) or 'default'}" for n, o in CASES])
def test_declared_largest_matrix_is_the_traced_one(name, options, batch, world_size):
    objective = build_objective([{"name": name, "options": options}], rank=0, world_size=world_size,
                                dataset_size=1000, index_size=1000)
    traced, shape = traced_peak(objective, batch, world_size, steps=3)
    declared = objective.largest_matrix(batch)
    if name == "regions" and options["base"] != "clip":
        # each region's own rows and columns on a CPU: at most the gathered batch, which is what is declared
        assert traced <= declared, (shape, declared)
    else:
        assert traced == declared, (shape, declared)


def _recipes():
    return sorted(p for p in (ROOT / "configs").rglob("*.yaml") if "accelerate" not in p.parts)


def _launch(recipe) -> tuple[int, bool]:
    """(processes, on GPUs) of the accelerate config its Launch line names ((1, False) without one)."""
    launch = re.search(r"# Launch:(.*(?:\\\n#.*)*)", recipe.read_text())  # the line and its continuations
    m = launch and re.search(r"--config_file (\S+)", launch.group(1))
    if not m:
        return 1, False
    accelerate = yaml.safe_load((ROOT / m.group(1)).read_text())
    n = re.search(r"--num_processes (\d+)", launch.group(1))
    return int(n.group(1)) if n else accelerate["num_processes"], not accelerate.get("use_cpu", False)


@pytest.mark.parametrize("recipe", _recipes(), ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_every_shipped_recipe_fits_and_says_its_batch(recipe):
    cfg = load_config(recipe)
    (ranks, gpus), batch = _launch(recipe), cfg.data.batch_size
    if cfg.data.naflex is not None:  # the token budget's largest step (its shortest length)
        batch = cfg.data.naflex.max_tokens_per_batch // min(cfg.data.naflex.seq_lens)
    objective = build_objective([t.model_dump() for t in cfg.loss], rank=0, world_size=ranks,
                                dataset_size=3_000_000, index_size=3_000_000)
    model_cfg = factory.resolve_model_cfg(cfg.model.arch, cfg.model.text_model, cfg.model.overrides)
    if is_coca(model_cfg):  # the caption decoder's logits, as the trainer counts them
        objective.for_decoder(*decoder_shape(model_cfg))
    vision = model_cfg.get("vision_cfg", {})
    if vision.get("patch_size"):  # masked_prediction's rows: the tower's patches, as the trainer sets them
        objective.for_tower((vision["image_size"] // vision["patch_size"]) ** 2)
    fp32 = 4 * objective.largest_matrix(batch)
    assert fp32 <= GIB, f"{recipe.name}: {fp32 / GIB:.2f} GiB matrix at {ranks} x {batch}"
    if gpus:  # a GPU recipe states its per-GPU and global batch, and what keeps it in memory
        text = recipe.read_text()
        assert f"x {batch:,} = global batch {ranks * batch:,}." in text and "# Memory:" in text
