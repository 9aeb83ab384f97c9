"""``python -m mmpretrain.eval --model MODEL --dataset SPEC --task TASK [...]``.

MODEL: a run folder (latest checkpoint), an export folder, ``local-dir:DIR``, ``hf-hub:ID``, or an
open_clip architecture name with ``--pretrained``. Prints a table (each metric beside its chance
level) and, with ``--output``, adds the entries to a ``results.json``. Exit: 0 ok, 1 failed, 2 bad arguments.

Under ``accelerate launch`` the images are split across the processes and gathered (results equal one
process's); the main process prints and writes.
"""

from __future__ import annotations

import argparse
import json
import sys

from mmpretrain.eval import (
    TASKS,
    check_results_file,
    evaluate,
    expand_jobs,
    format_table,
    load_task_data,
    merge_results,
)
from mmpretrain.eval.datasets import BadEvalData
from mmpretrain.eval.zero_shot import named_templates
from mmpretrain.process import current_process


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mmpretrain.eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="run folder, export folder, local-dir:DIR, hf-hub:ID or arch")
    p.add_argument("--pretrained", default=None, help="open_clip pretrained tag or file (with an arch name)")
    p.add_argument("--dataset", required=True, nargs="+",
                   help="dataset folder(s): clip_benchmark wds layout (wds:DIR) or shards (shards:DIR); for "
                        "image_caption_selection sugar_crepe[/SPLIT]:DIR (val2017/ + SPLIT.json) or winoground[:DIR]")
    p.add_argument("--task", required=True, nargs="+", choices=list(TASKS), help="one task per dataset, or one for all")
    p.add_argument("--templates", default=None,
                   help="zero-shot prompts: openai_imagenet, simple_imagenet, default, or a file (one {c} per line); "
                   "default: the dataset's own, else default")
    p.add_argument("--recall_k", type=int, nargs="+", default=[1, 5, 10])
    p.add_argument("--batch_size", type=int, default=256)
    p.add_argument("--num_workers", type=int, default=2, help="DataLoader workers decoding and preprocessing")
    p.add_argument("--device", default=None, help="default: this process's accelerator device, else cpu")
    p.add_argument("--output", default=None, help="results.json to create or add to")
    p.add_argument("--interpolate", nargs="?", const="run", default=None, metavar="PRETRAINED",
                   help="WiSE-FT curve: evaluate (1 - alpha) x PRETRAINED + alpha x MODEL at each --alpha (PRETRAINED "
                        "as model.pretrained takes it; without a value, the run's own model.pretrained)")
    p.add_argument("--alpha", type=float, nargs="+", default=None, help="with --interpolate: values in [0, 1]")
    p.add_argument("--naflex-seq-len", type=int, nargs="+", default=None, metavar="N",
                   help="a NaFlex model at N image patches, one entry per N (default: a run's longest training "
                        "length, else the model's position table's)")
    p.add_argument("--num-beams", type=int, default=6,
                   help="captioning: beam search over this many beams (1: greedy)")
    p.add_argument("--max-caption-len", type=int, default=30, help="captioning: tokens per caption at most, "
                   "start and end tokens included")
    p.add_argument("--min-caption-len", type=int, default=5, help="captioning: no end token before this many")
    args = p.parse_args(argv)
    if args.num_beams < 1 or not 1 <= args.min_caption_len < args.max_caption_len:
        p.error("--num-beams must be >= 1 and 1 <= --min-caption-len < --max-caption-len")
    if args.naflex_seq_len is not None and (min(args.naflex_seq_len) < 1 or args.interpolate is not None):
        p.error("--naflex-seq-len takes positive lengths, without --interpolate")
    if (args.interpolate is None) != (args.alpha is None):
        p.error("--interpolate and --alpha go together: --interpolate PRETRAINED --alpha 0 0.5 1")
    if args.alpha is not None and not all(0.0 <= a <= 1.0 for a in args.alpha):
        p.error(f"--alpha {' '.join(f'{a:g}' for a in args.alpha)}: each must be in [0, 1] (0: PRETRAINED, 1: MODEL)")
    if len(args.task) not in (1, len(args.dataset)):
        print("error: give one --task, or one per --dataset", file=sys.stderr)
        return 2
    tasks = args.task * len(args.dataset) if len(args.task) == 1 else args.task
    try:
        jobs = expand_jobs(list(zip(args.dataset, tasks)))  # sugar_crepe:DIR -> one dataset per split
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tasks = [t for _, t in jobs]
    if args.output:
        try:
            check_results_file(args.output)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    proc = current_process()
    device = args.device or proc.device
    try:
        # every dataset is checked before the model loads, and before open_clip is imported (~5 s): a
        # wrong path or a broken dataset is answered at once
        data = [load_task_data(d, t) for d, t in jobs]
        from mmpretrain.models.from_disk import load_model

        try:
            model, preprocess, tokenizer = load_model(args.model, device=device, pretrained=args.pretrained)
        except (FileNotFoundError, ValueError) as e:
            raise ValueError(f"--model {args.model}: {e}") from None
        if args.templates:
            templates = named_templates(args.templates)
            for ds in data:
                if hasattr(ds, "templates"):
                    ds.templates = templates
    except BadEvalData as e:  # the dataset is there but broken: the data, not the command, needs fixing
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from mmpretrain.models.naflex import NaFlexInputs

    naflex = isinstance(model, NaFlexInputs)
    if args.naflex_seq_len is not None and not naflex:
        print(f"error: --naflex-seq-len: --model {args.model} is not a NaFlex model (its image tower takes "
              "square images); drop the flag", file=sys.stderr)
        return 2
    if naflex and args.interpolate is not None:
        print("error: --interpolate does not take a NaFlex model yet: evaluate each with --naflex-seq-len",
              file=sys.stderr)
        return 2

    if "captioning" in tasks:
        from mmpretrain.eval.captioning import check_captioner

        try:
            check_captioner(model, tokenizer)
        except ValueError as e:
            print(f"error: --model {args.model}: {e}", file=sys.stderr)
            return 2
    generation = {"num_beams": args.num_beams, "max_len": args.max_caption_len, "min_len": args.min_caption_len}

    def evaluate_all(tag: str = "", pre=None) -> list[dict]:
        features: dict = {}  # one model: the probe tasks on a dataset share its image pass
        return [evaluate(model, pre or preprocess, tokenizer, d, task, model_name=args.model + tag,
                         batch_size=args.batch_size, recall_k=args.recall_k, device=device,
                         num_workers=args.num_workers, rank=proc.rank, world_size=proc.world_size, features=features,
                         generation=generation)
                for d, task in zip(data, tasks)]

    try:
        if naflex:  # one entry per length, named by it
            from mmpretrain.data.naflex import NaFlexPreprocess

            lengths = args.naflex_seq_len or [preprocess.seq_len]
            entries = [e for n in lengths for e in evaluate_all(
                f"@{n}", NaFlexPreprocess(n, preprocess.patch_size, preprocess.mean, preprocess.std))]
        elif args.interpolate is None:
            entries = evaluate_all()
        else:
            from mmpretrain.eval.wise_ft import sweep
            from mmpretrain.export.wise_ft import WiseFTError, pretrained_for

            try:
                spec, arch = pretrained_for(args.model, args.interpolate)
                entries = sweep(model, args.alpha, spec, arch, evaluate_all)
            except (WiseFTError, ValueError, FileNotFoundError) as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
    except (ValueError, FileNotFoundError) as e:  # the data does not hold what the task needs
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not proc.is_main:
        return 0
    captions = {i: e.pop("captions") for i, e in enumerate(entries) if "captions" in e}
    print(format_table(entries))
    if captions and args.output:
        from mmpretrain.eval.captioning import write_captions

        for i, rows in captions.items():
            entries[i]["captions_file"] = write_captions(args.output, entries[i], rows)
            print(f"captions: {entries[i]['captions_file']}")
    elif captions:
        print("captions: not kept (give --output to write them, one JSON line per image, beside results.json)")
    if args.output:
        merge_results(args.output, entries)
        if args.interpolate is not None:
            from pathlib import Path

            from mmpretrain.eval.wise_ft import plot_curve

            out = Path(args.output)
            plot = plot_curve(entries, out.with_name(out.stem + "_wise_ft.png"))
            if plot is not None:
                print(f"WiSE-FT curve: {plot}")
    else:
        print(json.dumps({"results": entries}, indent=2))
    return 0

