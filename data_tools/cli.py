"""``python -m data_tools {build,embed,filter,negatives,verify,stats}``. Exit codes: 0 ok, 1 the work failed, 2 bad arguments."""

from __future__ import annotations

import argparse
import json
import os
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m data_tools", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("build", help="write WebDataset shards (+ sizes.json, manifest.json) from a source")
    b.add_argument("source", help="a .tsv/.csv/.parquet table, an image folder, an img2dataset output folder, "
                   "a saved HF dataset folder or hf:NAME[:SPLIT], or demo:openmoji / demo:openmoji-all / demo:mnist (packaged real data)")
    b.add_argument("--out", required=True, help="dataset folder to write (demo sources: train/ and test/ inside)")
    b.add_argument("--source-type", default=None, choices=["table", "folder", "img2dataset", "hf", "demo"],
                   help="force the source kind instead of detecting it from the path")
    b.add_argument("--image-column", default=None, help="table/HF column with the image (default: image)")
    b.add_argument("--caption-column", default=None, help="table/HF column with the caption (default: caption; HF: text)")
    b.add_argument("--extra-captions-column", default=None, metavar="COLUMN",
                   help="table/HF column with more captions per image (a list, or a JSON array in TSV/CSV): kept as "
                   "'captions' in each sample's json; training draws one caption per epoch (data.captions)")
    b.add_argument("--negative-captions-column", default=None, metavar="COLUMN",
                   help="table/HF column with hard-negative captions per image (as --extra-captions-column): kept as "
                   "'negative_captions' in each sample's json, for objective.options.hard_negatives")
    b.add_argument("--key-column", default=None, help="table column with sample keys (default: the row number)")
    b.add_argument("--base-dir", default=None, help="folder that table image paths are relative to (default: the table's)")
    b.add_argument("--captions", default=None, help="image folder: captions file (TSV/CSV file,caption or JSON)")
    b.add_argument("--image-size", type=int, default=256, help="shorter image side after resize (px)")
    b.add_argument("--shard-size", type=int, default=1000, help="samples per shard (one source chunk each)")
    b.add_argument("--shard-bytes", type=float, default=1e9, help="bytes per shard before a part file starts")
    b.add_argument("--image-format", choices=["jpg", "png"], default=None, help="re-encoding (default jpg; demo png)")
    b.add_argument("--quality", type=int, default=95, help="JPEG quality")
    b.add_argument("--max-pixels", type=int, default=64_000_000, help="skip larger images (decompression bombs)")
    b.add_argument("--workers", type=int, default=max(1, min(4, os.cpu_count() or 1)),
                   help="processes writing shards (also split across ranks under accelerate launch)")
    b.add_argument("--limit", type=int, default=None, help="demo/folder: use only the first N items")
    b.add_argument("--overwrite", action="store_true", help="replace an existing dataset in --out")
    b.add_argument("--second-style", default=None, metavar="NOTO_DIR",
                   help="demo:openmoji-all: the unpacked npm emoji-datasource-google@16.0.0 (`make noto`); writes "
                   "OUT/noto/, the held-out emoji in Noto's drawing style")

    e = sub.add_parser("embed", help="frozen sentence-transformer caption embeddings, stored beside the shards "
                       "(no shard is rewritten)")
    e.add_argument("dir", help="dataset folder, a folder of split folders (train/, test/), or a shard pattern "
                   "(local or remote, with a sizes.json beside the shards)")
    e.add_argument("--out", default=None, help="embedding folder (default: the dataset folder; one subfolder per "
                   "split folder)")
    e.add_argument("--model", default=None, help="sentence-transformer Hub ID or local folder (the caption rows; "
                   "optional with --image-model)")
    e.add_argument("--image-model", action="append", default=None, metavar="M",
                   help="a CLIP teacher: an open_clip architecture (with --pretrained), hf-hub:ID, or a run/export "
                   "folder; its image embeddings of each image's evaluation view and K training crops, the crops, "
                   "and its text embeddings of every caption go beside the shards (teachers.json). Repeat for an "
                   "ensemble (they share the crops)")
    e.add_argument("--pretrained", default=None, help="open_clip pretrained tag for --image-model ARCH")
    e.add_argument("--augmentations", type=int, default=None, metavar="K",
                   help="training crops per image the teacher embeds (default: the K the folder's teachers.json "
                   "records, else 10)")
    e.add_argument("--seed", type=int, default=0, help="seed of the teachers' crops (with the sample key)")
    e.add_argument("--crop-scale", type=float, nargs=2, default=(0.9, 1.0), metavar=("LO", "HI"),
                   help="the crops' area fraction range (default open_clip's training 0.9 1.0)")
    e.add_argument("--crop-ratio", type=float, nargs=2, default=(3 / 4, 4 / 3), metavar=("LO", "HI"),
                   help="the crops' aspect ratio range (default 3/4 4/3)")
    e.add_argument("--overwrite", action="store_true", help="embed every shard again, also with another model "
                   "than the one recorded")
    e.add_argument("--batch-size", type=int, default=256)
    e.add_argument("--device", default=None, help="cpu, cuda, ... (default: best available)")

    f = sub.add_parser("filter", help="a keep-list of the samples to train on (data.keep), from rules that compose; "
                       "no shard is rewritten")
    f.add_argument("dir", help="dataset folder (with sizes.json)")
    f.add_argument("--out", default=None, help="keep-list folder to write (default: DIR/keep)")
    f.add_argument("--embeddings", default=None, help="folder of the stored rows (embed --out); default: beside the shards")
    f.add_argument("--overwrite", action="store_true", help="replace the keep-list --out holds (only its own files)")
    f.add_argument("--seed", type=int, default=0, help="seed of k-means and of the balancing draws")
    f.add_argument("--uids", default=None, metavar="NPY", help="keep only the samples a DataComp UID list (.npy) names "
                   "(matched on each sample's json uid, else its key)")
    f.add_argument("--basic", action="store_true", help="DataComp's basic filter: image short side >= 200 px, aspect "
                   "ratio < 3, caption of 3 or more words and 6 or more characters")
    f.add_argument("--language", default=None, metavar="LANG", help="keep captions langid detects as LANG (e.g. en)")
    f.add_argument("--decontaminate", nargs="+", default=None, metavar="EVAL_DIR",
                   help="remove training images near any image of these evaluation dataset folders (embedded with "
                   "the same --image-model teacher)")
    f.add_argument("--decontaminate-threshold", type=float, default=0.95, metavar="COS",
                   help="cosine above which a training image is a copy of an evaluation image (default 0.95)")
    f.add_argument("--dedup", choices=["image", "caption"], default=None,
                   help="SemDeDup on the teacher's image rows or the caption model's rows")
    f.add_argument("--threshold", type=float, default=0.95, metavar="COS",
                   help="--dedup: a sample goes when an earlier member of its cluster is above this cosine (0.95)")
    f.add_argument("--clusters", type=int, default=None, metavar="K",
                   help="k-means clusters of --dedup and --balance cluster (default sqrt(n): the least work)")
    f.add_argument("--score", choices=["teacher"], default=None,
                   help="score each pair by the stored teacher's image-caption cosine; with --keep-top / --min-score")
    f.add_argument("--keep-top", type=float, default=None, metavar="FRACTION", help="--score: keep this best fraction")
    f.add_argument("--min-score", type=float, default=None, metavar="S", help="--score: keep scores >= S")
    f.add_argument("--score-caption", choices=["first", "best"], default="first",
                   help="--score: caption 0's cosine (default), or the best of the sample's captions")
    f.add_argument("--teacher", default=None, help="which stored teacher (model or id) scores (default: the first)")
    f.add_argument("--balance", choices=["subgroup", "cluster", "entries"], default=None,
                   help="MetaCLIP-style: at most about --cap samples per subgroup (json 'subgroup'), k-means cluster "
                   "of the teacher's image rows, or metadata entry matched in the caption (--entries)")
    f.add_argument("--cap", type=int, default=None, metavar="N", help="--balance: samples kept per entry")
    f.add_argument("--entries", default=None, metavar="FILE", help="--balance entries: one entry a line")

    n = sub.add_parser("negatives", help="rule-based hard-negative captions (swap two content words, replace one with "
                       "another caption's word) into each sample's json as 'negative_captions', in a copy of the shards")
    n.add_argument("dir", help="dataset folder (sizes.json + shards)")
    n.add_argument("--out", required=True, help="folder for the copy with negatives")
    n.add_argument("--rules", nargs="+", default=["swap", "replace"], help="swap and/or replace (default: both)")
    n.add_argument("--seed", type=int, default=0, help="seeds every draw with the sample key (default 0)")
    n.add_argument("--overwrite", action="store_true", help="replace a dataset an earlier command wrote to --out")
    n.add_argument("--layout", choices=["shards", "sugar_crepe"], default="shards",
                   help="shards: a copy of the dataset with negatives (default); sugar_crepe: an evaluation set in "
                        "SugarCrepe's layout (val2017/ + swap_obj.json / replace_obj.json) for image_caption_selection")

    v = sub.add_parser("verify", help="read every sample back and check it against sizes.json and the manifest")
    v.add_argument("dir")
    v.add_argument("--embeddings", default=None, help="embedding folder (embed --out); default: beside the shards")
    v.add_argument("--strict", action="store_true", help="exit 1 on any problem (default: only on missing "
                   "shards, unreadable tars and count mismatches)")

    s = sub.add_parser("stats", help="print sample counts, caption and image statistics as JSON; "
                       "write DIR/stats.png")
    s.add_argument("dir")
    s.add_argument("--embeddings", default=None, help="embedding folder (embed --out); default: beside the shards")
    s.add_argument("--keep", default=None, metavar="LIST", help="a keep-list (filter --out): its kept and removed counts "
                   "per rule and shard")
    return p


def _filter(args) -> int:
    from data_tools.filter import FilterError, filter_dataset

    if args.score and args.keep_top is None and args.min_score is None:
        raise FilterError("--score teacher needs --keep-top FRACTION or --min-score S")
    if (args.keep_top is not None or args.min_score is not None) and not args.score:
        raise FilterError("--keep-top / --min-score need --score teacher")
    if args.keep_top is not None and not 0 < args.keep_top <= 1:
        raise FilterError(f"--keep-top {args.keep_top}: give a fraction in (0, 1]")
    if args.min_score is not None and not -1 <= args.min_score <= 1:  # NaN too
        raise FilterError(f"--min-score {args.min_score}: the score is a cosine, give S in [-1, 1]")
    if args.balance and (args.cap is None or args.cap < 1):
        raise FilterError("--balance needs --cap N (N >= 1 samples per entry)")
    if (args.balance == "entries") != bool(args.entries):
        raise FilterError("--balance entries and --entries FILE go together")
    for name in ("uids", "entries"):
        path = getattr(args, name)
        if path and not os.path.isfile(path):
            raise FilterError(f"--{name} {path}: no such file")
    if args.clusters is not None and args.clusters < 1:
        raise FilterError("--clusters must be 1 or more")
    if not -1 <= args.threshold <= 1 or not -1 <= args.decontaminate_threshold <= 1:
        raise FilterError("--threshold and --decontaminate-threshold are cosines, in [-1, 1]")
    index = filter_dataset(args.dir, args.out, overwrite=args.overwrite, embeddings=args.embeddings,
                           teacher=args.teacher, uids=args.uids, basic=args.basic, language=args.language,
                           decontaminate=args.decontaminate, decontaminate_threshold=args.decontaminate_threshold,
                           dedup=args.dedup, threshold=args.threshold, clusters=args.clusters, score=args.score,
                           keep_top=args.keep_top, min_score=args.min_score, score_caption=args.score_caption,
                           balance=args.balance, cap=args.cap, entries=args.entries, seed=args.seed)
    print(json.dumps({k: v for k, v in index.items() if k not in ("shards", "files")}, indent=2))
    return 0


def _run(args) -> int:
    if args.cmd == "build":
        from data_tools.build import build

        if args.image_size <= 0 or args.shard_size <= 0 or (args.limit is not None and args.limit <= 0):
            print("error: --image-size, --shard-size and --limit must be positive", file=sys.stderr)
            return 2
        summary = build(args.source, args.out, image_size=args.image_size, shard_size=args.shard_size,
                        limit=args.limit, image_format=args.image_format, overwrite=args.overwrite,
                        source_type=args.source_type, image_column=args.image_column,
                        caption_column=args.caption_column, key_column=args.key_column, base_dir=args.base_dir,
                        captions=args.captions, workers=args.workers, shard_bytes=args.shard_bytes,
                        quality=args.quality, max_pixels=args.max_pixels, second_style=args.second_style,
                        extra_captions_column=args.extra_captions_column,
                        negative_captions_column=args.negative_captions_column)
        print(json.dumps(summary, indent=2))
        return 0
    if args.cmd == "embed":
        from data_tools.embed import EmbedError, embed

        if args.model is None and not args.image_model:
            raise EmbedError("give --model (caption rows from a sentence-transformer), --image-model (a CLIP "
                             "teacher's rows), or both")
        out = {}
        if args.model is not None:
            out["captions"] = embed(args.dir, args.model, out=args.out, overwrite=args.overwrite,
                                    batch_size=args.batch_size, device=args.device)
        if args.image_model:
            from data_tools.embed_teacher import embed_teachers

            out["teachers"] = embed_teachers(args.dir, args.image_model, pretrained=args.pretrained,
                                             augmentations=args.augmentations, out=args.out, overwrite=args.overwrite,
                                             batch_size=args.batch_size, device=args.device, seed=args.seed,
                                             scale=args.crop_scale, ratio=args.crop_ratio)
        print(json.dumps(out["captions"] if list(out) == ["captions"] else out, indent=2))
        return 0
    if args.cmd == "filter":
        return _filter(args)
    if args.cmd == "negatives":
        from data_tools.negatives import negatives, sugar_crepe_layout

        make = sugar_crepe_layout if args.layout == "sugar_crepe" else negatives
        print(json.dumps(make(args.dir, args.out, rules=tuple(args.rules), seed=args.seed, overwrite=args.overwrite),
                         indent=2))
        return 0
    if args.cmd == "verify":
        from data_tools.inspect import FATAL, verify

        failed = False
        for folder, problems in verify(args.dir, args.embeddings).items():
            total = sum(len(v) for v in problems.values())
            print(f"{folder}: {'ok' if not total else f'{total} problem(s)'}")
            for kind, lines in sorted(problems.items()):
                print(f"  {kind}: {len(lines)}")
                for line in lines[:10]:
                    print(f"    {line}")
                failed |= args.strict or kind in FATAL
        return 1 if failed else 0
    from data_tools.inspect import stats

    print(json.dumps(stats(args.dir, args.embeddings, keep=args.keep), indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from data_tools.build import BuildError
    from data_tools.embed import EmbedError
    from data_tools.filter import FilterError

    try:
        return _run(args)
    except (BuildError, EmbedError, FilterError) as e:  # raised before any work: bad arguments
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as e:  # a dataset folder that is not one (a malformed sizes.json, ...)
        print(f"error: {e}", file=sys.stderr)
        return 2
