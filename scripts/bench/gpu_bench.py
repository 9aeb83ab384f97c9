"""The GPU check (run by scripts/bench/bench_gpu.sh on a lent GPU machine; its CPU path runs in `make test-slow`).

    python scripts/bench/gpu_bench.py --data DATASET_DIR --out DIR [--sections step jpeg_faults crop_stage loss_memory precision
                                                                             engines kmeans]
                                [--model ViT-B-32] [--batch-size 256] [--steps 20] [--repeats 3]
                                [--e2e-steps 100] [--e2e-images N] [--e2e-workers N] [--budget 510]
                                [--loss-batch 65536] [--device cuda] [--precision bf16] [--peak-tflops N]
                                [--engines ddp fsdp deepspeed] [--engine-wrapper SCRIPT]
                                [--watchdog [KEY=]S] [--fault KEY[:raise|hang|crash|context]]

DATASET_DIR is a built and embedded dataset folder (``train/``, ``test/``; ``make gpu-bundle`` builds one
small enough to carry). gpu.json in DIR starts with the versions that run (the machine's own or the
bundle's) and gains each measurement as soon as it finishes, so a run cut short keeps what it measured.
This process measures nothing: it runs a preflight (gpu_preflight.py), then the plan's groups of
measurements, each in a worker process under a per-measurement watchdog (gpu_runner.py: cheap in-process
ones first, the JPEG probe alone, the end-to-end sides, the engine launches last). A measurement whose
estimate (ESTIMATE_S, one H100/H200) would end past --budget seconds is skipped and says so. Sections:

  step         our real ``train_step`` -- the project's own ``setup`` (loader, uint8 batch normalised on
               the device, text trimmed on the host, fused AdamW, clamp) -- against open_clip_train's
               ``train_one_epoch`` body (``ClipLoss``, torch's default AdamW, float batch normalised on
               the host, full-length tokens) on the same batch; samples/s and model-FLOP utilisation:
               FLOPs of one step counted by torch.utils.flop_counter (each side its own: ours runs the
               trimmed text) x steps/s / the device's dense bf16 peak (from its name, or --peak-tflops).
               Blocks alternate (ABBA) and the median of --repeats is reported. Then end to end
               (gpu_end_to_end.py): whole steps from --e2e-images photo JPEGs made on the machine (224 px),
               ours with data.decode=worker and data.decode=device against open_clip_train's loader + step.
  jpeg_faults  the device decoder on a JPEG cut short (ending in EOI), a progressive one cut in its first
               scan and one with broken Huffman tables: whether nvJPEG raises, fills with libjpeg's grey or
               returns other pixels, and what DeviceDecoder counts (``rule_holds``: the truncated_jpeg rule
               of mmpretrain/data/jpeg.py finds the cut ones on the device as on the host).
  crop_stage   data.decode=device's crop stage on 256 photos (224 px) the device takes: per-image (the
               earlier code) against batched (mmpretrain/data/resample.py), host ms to issue and device ms to
               finish a batch, pixel difference from the worker path, the nvJPEG backend, the decode's ms.
  loss_memory  peak CUDA memory above the inputs of one forward + backward of the tiled clip objective
               and of open_clip's ClipLoss at B = --loss-batch (D = 512).
  precision    every objective (tiled and not) under autocast in bf16 against fp32 on the device: relative
               error of value and feature gradient (mmpretrain/testing/precision.py, the CPU test's cases).
  engines      ``accelerate launch`` with configs/accelerate/{fsdp,deepspeed-zero2}.yaml (``--engines ddp`` adds
               1gpu.yaml), 1 process:
               train 6 steps (checkpoints at 3 and 6) and resume to 8 with each; ``mmpretrain.export`` of
               the FSDP and DeepSpeed runs, ``mmpretrain.eval`` of the FSDP run (STAGES: 7 cold launches);
               torch AdamW throughout (DeepSpeed wraps it in its ZeRO-2 optimizer). --engine-wrapper runs
               the FSDP/DeepSpeed launches through a script (the CPU test passes
               tests/scripts/gpu_engine_on_cpu.py, since accelerate refuses those engines without a GPU).
  kmeans       region weighting's k-means (mmpretrain.losses.clusters.kmeans: scikit-learn on the host)
               against a deterministic torch Lloyd on the device, 16,384 x 1,024 at 5, 10 and 20 centroids,
               warm-started as every refresh after the first is and cold: seconds and inertia.

``--device cpu`` with the tiny model runs every section's code (tests/test_gpu_bench.py). The code paths
use only APIs present in both the device image's torch 2.11 / torchvision 0.26 and this project's pins.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

# siblings (the script's folder is on sys.path, as for any script run by path)
from gpu_common import ROOT
from gpu_engines import ENGINES, STAGES, engine_smoke
from gpu_preflight import preflight
from gpu_runner import FAULT_KINDS, POISONED, Recorder, healthy, lookup, save, supervise, watched
from gpu_sections import (
    crop_stage_section,
    jpeg_faults_section,
    kmeans_section,
    loss_memory_section,
    peak_tflops,
    precision_section,
    step_section,
)

# ------------------------------------------------------------------------------------------------- plan

SECTIONS = ("loss_memory", "precision", "kmeans", "crop_stage", "step", "jpeg_faults", "engines")
E2E = ("photos", "ours_decode_worker", "ours_decode_device", "open_clip_train")
LAUNCH_S = 15  # one cold ``accelerate launch`` (or eval/export) on the device: imports, CUDA and NCCL start
WORKER_S = 10  # one worker process: torch, mmpretrain and a CUDA context
# seconds each measurement is expected to take on one H100/H200 at the defaults (gpu.json records what
# each took; docs/scale.md sets them beside the CPU rehearsal's). The end-to-end sides: ~8 s set-up +
# 138 steps x 256 photos at 1,300-2,000 images/s from 8 workers; the photos: 36,864 at 5.2 ms each on
# one core here, 16 processes there
ESTIMATE_S = {"preflight": 10, "loss_memory": 10, "precision": 10, "kmeans": 15, "crop_stage": 10,
              "step.fixed_batch": 25, "jpeg_faults": 5, "step.end_to_end.photos": 20,
              "step.end_to_end.ours_decode_worker": 35, "step.end_to_end.ours_decode_device": 35,
              "step.end_to_end.open_clip_train": 35,
              **{f"engines.{e}": LAUNCH_S * len(STAGES[e]) for e in ENGINES}}
# TF32 per section: the step and the data path as users train (the trainer turns it on on a GPU, as
# open_clip_train does); the comparisons against fp32 in true fp32; engines: each launch's trainer
TF32 = {"preflight": False, "step": True, "jpeg_faults": True, "crop_stage": True, "loss_memory": False,
        "precision": False, "engines": None, "kmeans": False}
VERSIONED = ("torch", "torchvision", "transformers", "accelerate", "open_clip_torch", "webdataset", "pydantic",
             "deepspeed", "timm", "scikit-learn", "scikit-image", "typing_extensions", "numpy")


def plan(args) -> list[list[str]]:
    """The measurements in order, one list per worker process: the cheap in-process ones first; then what
    can fault the CUDA context (the JPEG probe) alone; the end-to-end sides (loader workers); the engine
    launches last."""
    e2e = [f"step.end_to_end.{m}" for m in E2E] if args.e2e_steps else []
    groups = [["loss_memory", "precision", "kmeans", "crop_stage", "step.fixed_batch"], ["jpeg_faults"], e2e,
              [f"engines.{e}" for e in args.engines]]
    return [g for g in ([k for k in group if k.split(".")[0] in args.sections] for group in groups) if g]


def estimate(args) -> float:
    """The plan's seconds by the estimates, its worker starts and the preflight included."""
    groups = plan(args)
    return ESTIMATE_S["preflight"] + WORKER_S * (len(groups) + 1) + sum(ESTIMATE_S[k] for g in groups for k in g)


def limit(key: str, args) -> float:
    """The watchdog's limit for one measurement: 4x its estimate, at least a minute (--watchdog S for every
    measurement, --watchdog KEY=S for one)."""
    own = dict(w.split("=", 1) for w in args.watchdog if "=" in w)
    every = [w for w in args.watchdog if "=" not in w]
    return float(own.get(key) or (every[-1] if every else max(60.0, 4.0 * ESTIMATE_S[key])))


# ------------------------------------------------------------------------------------------------ worker

def measurement(key: str, args, device, data: Path, work: Path):
    """What measurement ``key`` runs, as a callable of no arguments."""
    from gpu_end_to_end import e2e_workers, images_needed, open_clip_side, ours_side, photo_shards

    simple = {"loss_memory": loss_memory_section, "precision": precision_section, "kmeans": kmeans_section,
              "crop_stage": crop_stage_section, "jpeg_faults": jpeg_faults_section, "preflight": preflight}
    if key in simple:
        return lambda: simple[key](args, device)
    if key == "step.fixed_batch":
        return lambda: step_section(args, device, data)
    if key.startswith("engines."):
        return lambda: engine_smoke(key.split(".")[1], args, data, work / "engines")
    B, W = args.batch_size, e2e_workers(args)
    photos = work / "photos"
    if key == "step.end_to_end.photos":
        n = images_needed(B, W, args.e2e_steps, args.e2e_images)

        def make() -> dict:
            photo_shards(photos, n, B)
            (photos / ".complete").touch()
            return {"images": n, "workers": W, "batch_size": B, "image_size": 224, "model": args.model}
        return make

    def side() -> dict:
        if not (photos / ".complete").exists():
            raise RuntimeError("no photos: step.end_to_end.photos did not finish")
        if key.endswith("open_clip_train"):
            return open_clip_side(args, device, photos, W)
        return ours_side(args, device, photos, key.rsplit("_", 1)[1], W, work / "tmp")
    return side


def worker(args, keys: list[str], path: Path, work: Path) -> int:
    """Runs ``keys`` in this process, each under the watchdog, skipping one whose estimate would end past
    the deadline (on CUDA); exits POISONED when a failure left the context unusable."""
    import gc

    import torch

    from mmpretrain.train.engine import tf32, tf32_state

    device = torch.device(args.device)
    rec = Recorder(json.loads(path.read_text()), path, args.fault)
    for key in keys:
        section = key.split(".")[0]
        if device.type == "cuda" and time.time() + ESTIMATE_S[key] > args.deadline:
            left = args.deadline - time.time()
            print(f"{key}: skipped (estimated {ESTIMATE_S[key]} s, {left:.0f} s of the budget left)", flush=True)
            rec.put(section, key.partition(".")[2] or None,
                    {"skipped": f"estimated {ESTIMATE_S[key]} s, {left:.0f} s of the budget left"})
            continue
        gc.collect()
        if device.type == "cuda":  # each measurement starts from an empty allocator and a fresh peak
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        want = TF32[section] and device.type == "cuda" if TF32[section] is not None else None
        with tf32(want) if want is not None else contextlib.nullcontext():
            if "tf32" not in rec.result["sections"].get(section, {}) and section != "preflight":
                rec.put(section, None, {"tf32": tf32_state() if want is not None else "each launch's trainer"})
            res = watched(rec, key, limit(key, args), work / "stacks", work / "current.json",
                          measurement(key, args, device, Path(args.data), work))
        if "error" in res and not healthy():
            print(f"{key}: the process can no longer run torch; a fresh one takes the rest", flush=True)
            return POISONED
    return 0


# ------------------------------------------------------------------------------------------------- main

def finish(result: dict, args, notes: list[str]) -> None:
    """What the supervisor adds once every worker is done: the end-to-end summary, each section's
    seconds (its measurements' sum) and the restarts."""
    from gpu_end_to_end import summary

    sections = result["sections"]
    e2e = sections.get("step", {}).get("end_to_end")
    if e2e:
        fixed = sections["step"].get("fixed_batch", {})
        peak = fixed.get("peak_tflops") if isinstance(fixed, dict) else None
        if peak is None and args.device.startswith("cuda"):
            import torch

            peak = peak_tflops(torch.device(args.device), args.peak_tflops)[0]
        e2e["summary"] = summary({k: v for k, v in e2e.items() if k != "photos"}, args.batch_size, peak)
        ratios = {k: v for k, v in e2e["summary"].items() if k.endswith("_over_open_clip") or k == "device_over_worker"}
        print(f"end to end: {ratios} (captions of at most {e2e['summary']['text_length_used']} tokens)", flush=True)
    fixed = sections.get("step", {}).get("fixed_batch", {})
    if isinstance(fixed, dict) and "speedup" in fixed:
        print(f"fixed batch: ours over open_clip_train {fixed['speedup']} (captions of at most "
              f"{fixed['text_length_used']} tokens: ours runs {fixed['tokens_ours']}, open_clip "
              f"{fixed['tokens_open_clip']})", flush=True)
    for section in {k.split(".")[0] for g in result["plan"] for k in g}:
        keys = [k for g in result["plan"] for k in g if k.split(".")[0] == section]
        got = [lookup(result, k) for k in keys]
        if "." in keys[0]:  # a section of several measurements: theirs summed
            sections[section]["seconds"] = round(sum((g or {}).get("seconds") or 0 for g in got), 1)
    result["seconds"] = {k: v.get("seconds") for k, v in sections.items()}
    result["restarts"] = notes


def versions() -> dict:
    """What ran: each package's version and whether it is the machine's own or the bundle's
    (bench_gpu.sh installs only what the machine lacks, into MMPT_SITE)."""
    import importlib.metadata as m

    site = os.environ.get("MMPT_SITE", "/tmp/mmpt-site")
    out = {}
    for name in VERSIONED:
        try:
            dist = m.distribution(name)
        except m.PackageNotFoundError:
            out[name] = None
            continue
        where = str(dist.locate_file(""))
        out[name] = {"version": dist.version, "from": "bundle" if where.startswith(site) else "machine"}
    return out


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="a built, embedded dataset folder (train/, test/)")
    p.add_argument("--out", default=str(ROOT / "bench_results"))
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    p.add_argument("--model", default="ViT-B-32")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=20, help="steps per timed block")
    p.add_argument("--repeats", type=int, default=3, help="timed blocks per side")
    p.add_argument("--e2e-steps", type=int, default=100, help="timed end-to-end steps per side (0: none)")
    p.add_argument("--e2e-images", type=int, default=0,
                   help="photo JPEGs made for the end-to-end steps, at least (default: what one epoch of warm-up + "
                        "timed steps needs)")
    p.add_argument("--e2e-workers", type=int, default=0, help="loader workers (0: cores - 2, at most 8)")
    p.add_argument("--budget", type=float, default=BUDGET_S,
                   help="seconds: a measurement whose estimate would end past it is skipped (and says so); "
                        "bench_gpu.sh derives it from the device's command limit")
    p.add_argument("--watchdog", action="append", default=[], metavar="[KEY=]S",
                   help="seconds a measurement (KEY=S: that one) may take before its stack is dumped and it is "
                        "abandoned (default: 4x its estimate, at least 60)")
    p.add_argument("--loss-batch", type=int, default=65536)
    p.add_argument("--precision-batch", type=int, default=4096)
    p.add_argument("--kmeans-rows", type=int, default=16384)
    p.add_argument("--kmeans-dim", type=int, default=1024)
    p.add_argument("--device", default="cuda")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak of the device (default: by name)")
    p.add_argument("--engines", nargs="+", choices=list(ENGINES), default=["fsdp", "deepspeed"],
                   help="engine smoke runs (default fsdp deepspeed: 7 cold launches; the step section already "
                        "trains under plain accelerate on the GPU)")
    p.add_argument("--engine-wrapper", default=None, help="script the FSDP/DeepSpeed launches run through")
    p.add_argument("--stage-timeout", type=int, default=300)
    p.add_argument("--fault", action="append", default=[], metavar="KEY[:KIND]",
                   help=f"make this measurement fail (the rehearsal's injections), KIND one of {', '.join(FAULT_KINDS)} "
                        "(default raise), e.g. step.end_to_end.ours_decode_device or jpeg_faults:context")
    p.add_argument("--worker", nargs="+", default=None, help=argparse.SUPPRESS)  # the supervisor's
    p.add_argument("--work", default=None, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


BUDGET_S = 510  # bench_gpu.sh's figure for a 600 s command limit (30 s to hand back, ~15 s install, 45 s grace)


def main() -> int:
    args = parse()
    out, data = Path(args.out), Path(args.data)
    path = out / "gpu.json"
    if args.worker:
        return worker(args, args.worker, path, Path(args.work))
    known = ["preflight", *ESTIMATE_S.keys() - {"preflight"}]
    for fault in args.fault:
        key, _, kind = fault.partition(":")
        if key not in known or (kind and kind not in FAULT_KINDS):
            print(f"error: --fault {fault} names no measurement and kind; one of: {', '.join(sorted(known))}, "
                  f"each optionally with :{'|:'.join(FAULT_KINDS)}", file=sys.stderr)
            return 2
    for w in args.watchdog:
        key, _, value = w.rpartition("=")
        if (key and key not in known) or not value.replace(".", "", 1).isdigit():
            print(f"error: --watchdog {w}: give seconds, or KEY=seconds with KEY one of {', '.join(sorted(known))}",
                  file=sys.stderr)
            return 2
    missing = [s for s in ("train", "test") if not (data / s).is_dir()]
    if missing:
        print(f"error: {data} has no {' or '.join(missing)}/ folder; build one with `make gpu-bundle` "
              "(or data_tools build + embed)", file=sys.stderr)
        return 2
    if out.exists() and not out.is_dir():
        print(f"error: --out {out} is a file; give a folder (gpu.json is written into it)", file=sys.stderr)
        return 2
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: no CUDA device (use --device cpu for the smoke path)", file=sys.stderr)
        return 2
    if args.device == "cpu":
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    out.mkdir(parents=True, exist_ok=True)
    groups = plan(args)
    result: dict = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                    "torch": torch.__version__, "versions": versions(), "command": " ".join(sys.argv),
                    "plan": groups, "estimate_s": {k: ESTIMATE_S[k] for g in [["preflight"], *groups] for k in g},
                    "estimated_total_s": estimate(args), "budget_s": args.budget, "sections": {}}
    print("versions: " + ", ".join(f"{k} {v['version']} ({v['from']})" for k, v in result["versions"].items() if v),
          flush=True)
    print(f"plan: {' | '.join(' '.join(g) for g in groups)}; estimated {estimate(args):.0f} s on one H100/H200 "
          f"(budget {args.budget:.0f} s)", flush=True)
    save(result, path)  # the versions, before anything can fail
    start, notes = time.time(), []
    with tempfile.TemporaryDirectory() as work:
        base = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--work", work,
                "--deadline", str(start + args.budget)]
        limits = {k: limit(k, args) for k in ESTIMATE_S}
        failed = supervise([["preflight"], *groups], lambda keys: [*base, "--worker", *keys], path, Path(work),
                           limits, notes)
    result = json.loads(path.read_text())
    pre = result["sections"].pop("preflight", {})
    result["preflight"] = {k: v for k, v in pre.items() if k != "seconds"}
    result["preflight_seconds"], result["wall_s"] = pre.get("seconds"), round(time.time() - start, 1)
    for name, line in result["preflight"].items():
        print(f"preflight {name}: {line}", flush=True)
    failed = [k for k in failed if k != "preflight"]
    failed += [f"preflight.{k}" for k, v in result["preflight"].items() if str(v).startswith("error")]
    finish(result, args, notes)
    save(result, path)
    if failed:
        print(f"error: failed: {', '.join(failed)} (the rest measured; see {path})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
