"""``python -m data_tools {build,embed,verify,stats}``. Exit codes: 0 ok, 1 the work failed, 2 bad arguments."""

from __future__ import annotations

import argparse
import json
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m data_tools", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("build", help="write WebDataset shards (+ sizes.json, manifest.json) from a source")
    b.add_argument("source", help="demo:openmoji (packaged real data; more source kinds follow)")
    b.add_argument("--out", required=True, help="dataset folder to write (train/ and test/ inside)")
    b.add_argument("--source-type", default=None, help="force the source kind instead of detecting it")
    b.add_argument("--image-size", type=int, default=256, help="shorter image side after resize (px)")
    b.add_argument("--shard-size", type=int, default=1000, help="samples per shard")
    b.add_argument("--image-format", choices=["jpg", "png"], default=None, help="re-encoding (demo: png)")
    b.add_argument("--limit", type=int, default=None, help="use only the first N items of the source")
    b.add_argument("--overwrite", action="store_true", help="replace an existing dataset in --out")

    e = sub.add_parser("embed", help="store frozen sentence-transformer caption embeddings in the shards")
    e.add_argument("dir", help="dataset folder, or a folder of split folders (train/, test/)")
    e.add_argument("--model", required=True, help="sentence-transformer Hub ID or local folder")
    e.add_argument("--overwrite", action="store_true", help="replace embeddings of another model")
    e.add_argument("--batch-size", type=int, default=256)
    e.add_argument("--device", default=None, help="cpu, cuda, ... (default: best available)")

    v = sub.add_parser("verify", help="read every sample back and check it against sizes.json and the manifest")
    v.add_argument("dir")
    v.add_argument("--strict", action="store_true", help="also require embeddings in every shard once recorded")

    s = sub.add_parser("stats", help="print sample counts, caption and image statistics as JSON")
    s.add_argument("dir")
    return p


def _run(args) -> int:
    if args.cmd == "build":
        from data_tools.build import build

        if args.source_type not in (None, "demo"):
            print(f"error: --source-type {args.source_type}: only 'demo' sources are supported so far",
                  file=sys.stderr)
            return 2
        if args.image_size <= 0 or args.shard_size <= 0 or (args.limit is not None and args.limit <= 0):
            print("error: --image-size, --shard-size and --limit must be positive", file=sys.stderr)
            return 2
        summary = build(args.source, args.out, image_size=args.image_size, shard_size=args.shard_size,
                        limit=args.limit, image_format=args.image_format, overwrite=args.overwrite)
        print(json.dumps(summary, indent=2))
        return 0
    if args.cmd == "embed":
        from data_tools.embed import embed

        print(json.dumps(embed(args.dir, args.model, overwrite=args.overwrite, batch_size=args.batch_size,
                               device=args.device), indent=2))
        return 0
    if args.cmd == "verify":
        from data_tools.inspect import verify

        bad = 0
        for folder, problems in verify(args.dir, strict=args.strict).items():
            print(f"{folder}: {'ok' if not problems else f'{len(problems)} problem(s)'}")
            for line in problems[:50]:
                print(f"  {line}")
            bad += len(problems)
        return 1 if bad else 0
    from data_tools.inspect import stats

    print(json.dumps(stats(args.dir), indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from data_tools.build import BuildError
    from data_tools.embed import EmbedError

    try:
        return _run(args)
    except (BuildError, EmbedError) as e:  # raised before any work: bad arguments
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
