"""Loss-internal peak memory and forward+backward time: our tiled objectives against open_clip's
ClipLoss and SigLipLoss, and tiled soft_target against untiled, on CPU in fp32.

    python scripts/bench/bench_loss.py                       # B in {4096, 16384}, D = 512
    python scripts/bench/bench_loss.py --batch 2048 --repeats 1  # quick look

Memory counts tensor storage created while the loss runs forward and backward (a dispatch-mode
counter, scripts/bench/benchlib.py), excluding the inputs and their .grad. Writes bench_results/loss.json:
headline ``ratio`` = clip's memory ratio (ours / open_clip, lower is better) at the largest batch.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.nn.functional as F

from mmpretrain.losses import LOSSES  # noqa: E402

from benchlib import measure, median, table, write_result  # noqa: E402


def make_inputs(b: int, d: int, e: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = F.normalize(torch.randn(b, d, generator=g), dim=-1).requires_grad_()
    y = F.normalize(torch.randn(b, d, generator=g), dim=-1).requires_grad_()
    t = F.normalize(torch.randn(b, e, generator=g), dim=-1)
    return x, y, t


def cases(x, y, t, chunk: int):
    from open_clip.loss import ClipLoss, SigLipLoss

    s_clip = torch.tensor(math.log(1 / 0.07)).exp()
    s_sig, bias = torch.tensor(10.0), torch.tensor(-10.0)

    def ours(name, chunk_size, scale, b=None, **opts):
        fn = LOSSES[name](chunk_size=chunk_size, **opts)
        return lambda: fn(image_features=x, text_features=y, logit_scale=scale, logit_bias=b,
                          target_embeddings=t)[f"{name}_loss"].backward()

    return {
        "clip": (ours("clip", chunk, s_clip), lambda: ClipLoss()(x, y, s_clip).backward(), "open_clip ClipLoss"),
        "sigmoid": (ours("sigmoid", chunk, s_sig, bias), lambda: SigLipLoss()(x, y, s_sig, bias).backward(),
                    "open_clip SigLipLoss"),
        "soft_target": (ours("soft_target", chunk, s_clip, target_temperature=0.1),
                        ours("soft_target", None, s_clip, target_temperature=0.1), "untiled soft_target"),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--target-dim", type=int, default=384)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.manual_seed(0)
    rows, extra = [], {"batches": {}, "chunk_size": args.chunk, "dim": args.dim, "threads": torch.get_num_threads()}
    headline_runs: list[float] = []
    for b in args.batch:
        x, y, t = make_inputs(b, args.dim, args.target_dim)
        per = {}
        for name, (ours, anchor, anchor_name) in cases(x, y, t, args.chunk).items():
            # alternate anchor / ours so drift on a shared machine hits both
            t_anchor, m_anchor = measure(anchor, (x, y), args.repeats)
            t_ours, m_ours = measure(ours, (x, y), args.repeats)
            entry = {
                "anchor": anchor_name,
                "memory_bytes": {"ours": m_ours, "anchor": m_anchor},
                "seconds": {"ours": t_ours, "anchor": t_anchor},
                "memory_ratio": m_ours / m_anchor,
                "time_ratio": median(t_ours) / median(t_anchor),
                "time_ratio_runs": [o / a for o, a in zip(t_ours, t_anchor)],
            }
            per[name] = entry
            rows.append((b, name, anchor_name, f"{m_ours / 2**20:.1f}", f"{m_anchor / 2**20:.1f}",
                         f"{entry['memory_ratio']:.4f}", f"{median(t_ours):.2f}", f"{median(t_anchor):.2f}",
                         f"{entry['time_ratio']:.2f}"))
            print(rows[-1], flush=True)
        extra["batches"][str(b)] = per
    largest = extra["batches"][str(max(args.batch))]
    for name in ("clip", "sigmoid", "soft_target"):
        extra[name] = {"memory_ratio": largest[name]["memory_ratio"], "time_ratio": largest[name]["time_ratio"]}
    headline_runs = [largest["clip"]["memory_ratio"]]
    print(table(rows, ("B", "objective", "anchor", "ours MiB", "anchor MiB", "mem ratio", "ours s", "anchor s",
                       "time ratio")))
    path = write_result("loss", largest["clip"]["memory_ratio"], False, 0.02, headline_runs, extra)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
