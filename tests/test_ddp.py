"""Data parallelism through ``accelerate launch`` on 2 CPU processes: objectives that leave a model
parameter unused still train, and every rank draws its own dropout / patch-dropout masks (both from
the one launch of the ``ddp_checks`` fixture)."""


def test_ddp_trains_objectives_that_leave_a_parameter_unused(ddp_checks):
    for case in ("vrn", "align_uniform", "clip_with_bias"):
        assert ddp_checks.get(f"unused_{case}") == "ok", ddp_checks


def test_each_rank_draws_its_own_dropout_masks(ddp_checks):
    assert ddp_checks["same_initial_weights"], ddp_checks  # the model starts the same on every rank
    assert ddp_checks["masks_differ"], ddp_checks  # but patch dropout on the same images draws other masks on rank 1
