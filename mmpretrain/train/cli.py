"""``python -m mmpretrain.train --config FILE [a.b=value ...]`` (also ``accelerate launch -m mmpretrain.train``).
Exit codes: 0 success, 1 the work failed, 2 bad arguments or config (before any work)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mmpretrain.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML experiment config (see configs/)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100 data.batch_size=64")
    args = p.parse_args(argv)
    # The trainer imports torch, accelerate and open_clip (~9 s on 2 cores): after argument parsing, so
    # that --help and usage errors answer at once, and after the config is read and validated (torch
    # alone, ~3 s), so that a typo in a key or value is answered before open_clip is imported.
    from mmpretrain.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from mmpretrain.data.device_decode import DeviceDecodeError
    from mmpretrain.data.reader import StreamError
    from mmpretrain.train.disk import CheckpointWriteError
    from mmpretrain.train.loop import fit
    from mmpretrain.train.run_setup import setup

    try:
        run = setup(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    while True:  # train.phases: each phase set up again from its boundary's checkpoint, as a resume is
        try:
            summary = fit(run)
        except FloatingPointError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        except StreamError as e:
            print(f"error: {StreamError.line_of(e)}", file=sys.stderr)
            return 1
        except (DeviceDecodeError, CheckpointWriteError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        if not summary.get("phase_end"):
            break
        release(run)
        del run
        cfg = cfg.model_copy(update={"resume": summary["checkpoint"]})  # not a resume= the run began from
        try:
            run = setup(cfg)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    run.accelerator.end_training()
    return 0


def release(run) -> None:
    """A finished phase's run let go before the next is set up: its trackers closed (the process group
    stays), the accelerator's references to the model, optimizer and loader dropped, the memory collected."""
    import gc

    import torch

    for tracker in run.accelerator.trackers:
        tracker.finish()
    run.accelerator.free_memory()
    run.model = run.optimizer = run.loader = run.ema = run.task = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
