"""Data parallelism through ``accelerate launch`` on 2 CPU processes: objectives that leave a model
parameter unused still train, and every rank draws its own dropout / patch-dropout masks (both from
the one launch of the ``ddp_checks`` fixture)."""


def test_ddp_trains_objectives_that_leave_a_parameter_unused(ddp_checks):
    for case in ("vrn", "align_uniform", "clip_with_bias"):
        assert ddp_checks.get(f"unused_{case}") == "ok", ddp_checks


def test_each_rank_draws_its_own_dropout_masks(ddp_checks):
    assert ddp_checks["same_initial_weights"], ddp_checks  # the model starts the same on every rank
    assert ddp_checks["masks_differ"], ddp_checks  # but patch dropout on the same images draws other masks on rank 1


def test_a_loss_non_finite_on_one_rank_is_skipped_on_both_on_the_device(ddp_checks):
    """The non-finite flag is all-reduced and kept on the device (fused AdamW skips the update): rank 1's
    NaN at step 2 is counted once on both ranks at the next log step, and the ranks keep equal weights."""
    assert ddp_checks["nonfinite"] == {"counts": [1, 1], "same_weights": True, "finite_weights": True,
                                       "on_device": [True, True]}, ddp_checks
