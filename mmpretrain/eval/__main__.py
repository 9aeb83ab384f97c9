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

from mmpretrain.eval import TASKS, check_results_file, evaluate, format_table, load_task_data, merge_results
from mmpretrain.eval.datasets import BadEvalData
from mmpretrain.eval.zero_shot import named_templates
from mmpretrain.launch import current_process


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mmpretrain.eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="run folder, export folder, local-dir:DIR, hf-hub:ID or arch")
    p.add_argument("--pretrained", default=None, help="open_clip pretrained tag or file (with an arch name)")
    p.add_argument("--dataset", required=True, nargs="+",
                   help="dataset folder(s): clip_benchmark wds layout (wds:DIR) or shards (shards:DIR)")
    p.add_argument("--task", required=True, nargs="+", choices=list(TASKS), help="one task per dataset, or one for all")
    p.add_argument("--templates", default=None,
                   help="zero-shot prompts: openai_imagenet, simple_imagenet, default, or a file (one {c} per line); "
                   "default: the dataset's own, else default")
    p.add_argument("--recall_k", type=int, nargs="+", default=[1, 5, 10])
    p.add_argument("--batch_size", type=int, default=256)
    p.add_argument("--num_workers", type=int, default=2, help="DataLoader workers decoding and preprocessing")
    p.add_argument("--device", default=None, help="default: this process's accelerator device, else cpu")
    p.add_argument("--output", default=None, help="results.json to create or add to")
    args = p.parse_args(argv)
    if len(args.task) not in (1, len(args.dataset)):
        print("error: give one --task, or one per --dataset", file=sys.stderr)
        return 2
    tasks = args.task * len(args.dataset) if len(args.task) == 1 else args.task
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
        data = [load_task_data(d, t) for d, t in zip(args.dataset, tasks)]
        from mmpretrain.models.load import load_model

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
    features: dict = {}  # one model: the probe tasks on a dataset share its image pass
    try:
        entries = [evaluate(model, preprocess, tokenizer, d, task, model_name=args.model, batch_size=args.batch_size,
                            recall_k=args.recall_k, device=device, num_workers=args.num_workers,
                            rank=proc.rank, world_size=proc.world_size, features=features)
                   for d, task in zip(data, tasks)]
    except (ValueError, FileNotFoundError) as e:  # the data does not hold what the task needs
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not proc.is_main:
        return 0
    print(format_table(entries))
    if args.output:
        merge_results(args.output, entries)
    else:
        print(json.dumps({"results": entries}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
