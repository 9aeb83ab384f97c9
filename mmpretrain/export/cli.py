"""``python -m mmpretrain.export RUN_DIR --out DIR [...]``: the command line of :func:`mmpretrain.export.export`.
Exit: 0 ok, 2 a refusal or bad arguments (one line naming what to fix)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mmpretrain.export import ExportError, export
from mmpretrain.export import __doc__ as EXPORT_DOC


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mmpretrain.export", description=EXPORT_DOC,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="run folder (its latest complete checkpoint is exported)")
    p.add_argument("--out", required=True, help="export folder to write")
    p.add_argument("--format", default="open_clip", choices=["open_clip", "transformers"],
                   help="transformers: CLIPModel + CLIPProcessor (ViT image tower, open_clip text transformer)")
    p.add_argument("--towers", default="both", choices=["both", "image"],
                   help="image: the image encoder alone (with --format transformers)")
    p.add_argument("--push-to-hub", default=None, metavar="ORG/NAME", help="upload the folder to this Hub repo")
    p.add_argument("--private", action="store_true")
    p.add_argument("--revision", default=None)
    p.add_argument("--dry-run", action="store_true", help="with --push-to-hub: list what would be uploaded")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier export in --out (only the files its export_manifest.json lists)")
    p.add_argument("--ema", action="store_true",
                   help="export the checkpoint's weight average (train.ema) instead of the trained weights")
    p.add_argument("--interpolate", nargs="?", const="run", default=None, metavar="PRETRAINED",
                   help="WiSE-FT: export (1 - alpha) x PRETRAINED + alpha x the run's weights; PRETRAINED as "
                        "model.pretrained takes it (run or export folder, weights file, hf-hub:ID, open_clip tag); "
                        "without a value, the run's own model.pretrained")
    p.add_argument("--alpha", type=float, default=None,
                   help="with --interpolate: the fine-tuned share, in [0, 1] (0: PRETRAINED, 1: the run)")
    args = p.parse_args(argv)
    if args.alpha is not None and args.interpolate is None:
        p.error("--alpha needs --interpolate PRETRAINED")
    if args.interpolate is not None and (args.alpha is None or not 0.0 <= args.alpha <= 1.0):
        pre = "the run's model.pretrained" if args.interpolate == "run" else args.interpolate
        p.error(f"--interpolate needs --alpha in [0, 1] (0: {pre}, 1: the fine-tuned run); got {args.alpha}")
    try:
        files = export(args.run_dir, args.out, fmt=args.format, towers=args.towers, repo_id=args.push_to_hub,
                       overwrite=args.overwrite, interpolate=args.interpolate,
                       alpha=1.0 if args.alpha is None else args.alpha, ema=args.ema)
    except (ExportError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    for f in files:
        print(f"{f.relative_to(out)}\t{f.stat().st_size}")
    if args.push_to_hub:
        if args.dry_run:
            print(f"dry run: would upload {len(files)} files to {args.push_to_hub}")
        else:
            from mmpretrain.hub import push_folder

            pushed = push_folder(out, args.push_to_hub, private=args.private, revision=args.revision,
                                 allow_patterns=[str(f.relative_to(out)) for f in files])  # the export, nothing else
            print(f"pushed: {pushed}")
    return 0

