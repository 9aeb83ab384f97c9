"""The GPU check (run by scripts/bench/bench_gpu.sh on a lent GPU machine; its CPU path runs in `make test-slow`).

    python scripts/bench/gpu_bench.py --data DATASET_DIR --out DIR [--sections step jpeg_faults crop_stage loss_memory precision
                                                                             engines kmeans]
                                [--model ViT-B-32] [--batch-size 256] [--steps 20] [--repeats 3]
                                [--e2e-steps 20] [--e2e-images 4096] [--e2e-workers N] [--budget 240]
                                [--loss-batch 65536] [--device cuda] [--precision bf16] [--peak-tflops N]
                                [--engines ddp fsdp deepspeed] [--engine-wrapper SCRIPT]

DATASET_DIR is a built and embedded dataset folder (``train/``, ``test/``; ``make gpu-bundle`` builds one
small enough to carry). gpu.json in DIR starts with the versions that run (the machine's own or the
bundle's) and gains each section as soon as it finishes, so a run cut short keeps what it measured.
Sections run in this order (by value: what only a GPU can show first); one whose estimate (ESTIMATE_S,
one H200) would end past --budget seconds is skipped and says so:

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
               the FSDP and DeepSpeed runs, ``mmpretrain.eval`` of the FSDP run (STAGES: 6 cold launches);
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
import json
import os
import sys
import tempfile
import time
from pathlib import Path

# siblings (the script's folder is on sys.path, as for any script run by path)
from gpu_common import ROOT
from gpu_engines import ENGINES, engine_smoke
from gpu_sections import (
    crop_stage_section,
    jpeg_faults_section,
    kmeans_section,
    loss_memory_section,
    peak_tflops,
    precision_section,
    step_section,
)

# ------------------------------------------------------------------------------------------------- main

SECTIONS = ("step", "jpeg_faults", "crop_stage", "loss_memory", "precision", "engines", "kmeans")  # by value: what only a GPU shows first
# seconds each section is expected to take on one H200 at the defaults (the run's own budget check;
# gpu.json records what each took, to correct these): 240 s in all, the budget. step: ~25 s fixed-batch,
# ~20 s to make 36,864 photos (5.2 ms each on one core here, 16 processes there), 3 sides x (~8 s set-up
# + 138 steps at 1,300-2,000 images/s from 8 workers)
ESTIMATE_S = {"step": 130, "jpeg_faults": 5, "crop_stage": 10, "loss_memory": 10, "precision": 10, "engines": 60,
              "kmeans": 15}
MEASUREMENTS_E2E = ("photos", "ours_decode_worker", "ours_decode_device", "open_clip_train")
# TF32 per section: the step and the data path as users train (the trainer turns it on on a GPU, as
# open_clip_train does); the comparisons against fp32 in true fp32
TF32 = {"step": True, "jpeg_faults": True, "crop_stage": True, "loss_memory": False, "precision": False,
        "engines": None, "kmeans": False}  # engines: each launch's trainer sets its own
VERSIONED = ("torch", "torchvision", "transformers", "accelerate", "open_clip_torch", "webdataset", "pydantic",
             "deepspeed", "timm", "scikit-learn", "scikit-image", "typing_extensions", "numpy")


class Recorder:
    """gpu.json as it grows: each measurement runs on its own, and its result -- or its error with the
    traceback's last frames -- is written the moment it exists, so one failure takes nothing else with
    it and a run cut short keeps what it measured. ``fault``: a measurement (``section.name``) that
    raises at its start instead of running (the rehearsal's injected failure)."""

    def __init__(self, result: dict, path: Path, fault: str | None = None):
        self.result, self.path, self.fault, self.failed = result, path, fault, []

    def put(self, section: str, name: str | None, value: dict) -> dict:
        node = self.result["sections"].setdefault(section, {})
        if name is None:
            node.update(value)
        else:
            *parents, leaf = name.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
        save(self.result, self.path)
        return value

    def run(self, section: str, name: str | None, fn, *a, **kw) -> dict:
        key = f"{section}.{name}" if name else section
        t0 = time.perf_counter()
        try:
            if key == self.fault:
                raise RuntimeError(f"fault injected at {key} (--fault)")
            out = fn(*a, **kw)
            out = out if isinstance(out, dict) else {"value": out}
        except Exception as e:  # the error is the result; the other measurements go on
            import traceback

            traceback.print_exc()
            frames = traceback.extract_tb(e.__traceback__)[-4:]
            out = {"error": f"{type(e).__name__}: {e}"[:2000],
                   "traceback": [f"{Path(f.filename).name}:{f.lineno} in {f.name}: {f.line}" for f in frames]}
            self.failed.append(key)
        out["seconds"] = round(time.perf_counter() - t0, 1)
        if name is not None:  # a whole section's line is main's
            print(f"{key}: {'FAILED, ' if 'error' in out else ''}{out['seconds']} s -> {self.path}", flush=True)
        return self.put(section, name, out)


def end_to_end_measurements(rec: Recorder, args, device, peak: float | None) -> None:
    """The step section's end-to-end part: the photos, then each side as its own measurement."""
    from gpu_end_to_end import images_needed, open_clip_side, ours_side, photo_shards, summary

    B, W = args.batch_size, args.e2e_workers or max(1, min(8, (os.cpu_count() or 2) - 2))
    n = images_needed(B, W, args.e2e_steps, args.e2e_images)
    with tempfile.TemporaryDirectory() as tmp:
        photos = Path(tmp) / "photos"

        def make() -> dict:
            photo_shards(photos, n, B)
            return {"images": n, "workers": W, "batch_size": B, "image_size": 224, "model": args.model}

        if "error" in rec.run("step", "end_to_end.photos", make):
            return
        sides = {}
        for decode in ("worker", "device"):
            sides[f"ours_decode_{decode}"] = rec.run("step", f"end_to_end.ours_decode_{decode}", ours_side, args,
                                                     device, photos, decode, W, Path(tmp))
        sides["open_clip_train"] = rec.run("step", "end_to_end.open_clip_train", open_clip_side, args, device,
                                           photos, W)
        rec.put("step", "end_to_end.summary", summary(sides, B, peak))


def run_section(rec: Recorder, section: str, args, device, data: Path) -> None:
    from mmpretrain.train.engine import tf32, tf32_state

    want = TF32[section] and device.type == "cuda" if TF32[section] is not None else None
    with tf32(want) if want is not None else _nothing():
        rec.put(section, None, {"tf32": tf32_state() if want is not None else "each launch's trainer"})
        if section == "step":
            fixed = rec.run("step", "fixed_batch", step_section, args, device, data)
            if args.e2e_steps:  # after the fixed-batch models are freed
                end_to_end_measurements(rec, args, device, fixed.get("peak_tflops") or
                                        peak_tflops(device, args.peak_tflops)[0])
        elif section == "engines":
            with tempfile.TemporaryDirectory() as work:
                for engine in args.engines:
                    res = rec.run("engines", engine, engine_smoke, engine, args, data, Path(work))
                    if "error" not in res and not res["ok"]:
                        rec.failed.append(f"engines.{engine}")
        else:
            fn = {"jpeg_faults": jpeg_faults_section, "crop_stage": crop_stage_section,
                  "loss_memory": loss_memory_section, "precision": precision_section, "kmeans": kmeans_section}
            rec.run(section, None, fn[section], args, device)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


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


def save(result: dict, path: Path) -> None:
    """gpu.json, replaced whole (a run cut short keeps the sections it finished)."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(path)


def main() -> int:
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
    p.add_argument("--budget", type=float, default=240.0,
                   help="seconds: a section whose estimate would end past it is skipped (and says so)")
    p.add_argument("--loss-batch", type=int, default=65536)
    p.add_argument("--precision-batch", type=int, default=4096)
    p.add_argument("--kmeans-rows", type=int, default=16384)
    p.add_argument("--kmeans-dim", type=int, default=1024)
    p.add_argument("--device", default="cuda")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak of the device (default: by name)")
    p.add_argument("--engines", nargs="+", choices=list(ENGINES), default=["fsdp", "deepspeed"],
                   help="engine smoke runs (default fsdp deepspeed: 6 cold launches, ~60 s; the step section "
                        "already trains under plain accelerate on the GPU)")
    p.add_argument("--engine-wrapper", default=None, help="script the FSDP/DeepSpeed launches run through")
    p.add_argument("--stage-timeout", type=int, default=300)
    p.add_argument("--fault", default=None, metavar="SECTION[.MEASUREMENT]",
                   help="raise at the start of this measurement (the rehearsal's injected failure), e.g. "
                        "step.end_to_end.ours_decode_device")
    args = p.parse_args()
    known = [*(s for s in SECTIONS if s not in ("step", "engines")), "step.fixed_batch", *(f"step.end_to_end.{m}" for m in MEASUREMENTS_E2E),
             *(f"engines.{e}" for e in ENGINES)]
    if args.fault is not None and args.fault not in known:
        print(f"error: --fault {args.fault} names no measurement; one of: {', '.join(known)}", file=sys.stderr)
        return 2
    data = Path(args.data)
    missing = [s for s in ("train", "test") if not (data / s).is_dir()]
    if missing:
        print(f"error: {data} has no {' or '.join(missing)}/ folder; build one with `make gpu-bundle` "
              "(or data_tools build + embed)", file=sys.stderr)
        return 2
    import torch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device (use --device cpu for the smoke path)", file=sys.stderr)
        return 2
    if device.type == "cpu":
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        print(f"error: --out {out} is a file; give a folder (gpu.json is written into it)", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "versions": versions(), "command": " ".join(sys.argv),
                    "estimate_s": {k: ESTIMATE_S[k] for k in args.sections}, "sections": {}}
    print("versions: " + ", ".join(f"{k} {v['version']} ({v['from']})" for k, v in result["versions"].items() if v),
          flush=True)
    print(f"sections {' '.join(args.sections)}: estimated {sum(result['estimate_s'].values())} s on one H200 "
          f"(budget {args.budget:.0f} s)", flush=True)
    path = out / "gpu.json"
    save(result, path)  # the versions, before any section can fail
    rec = Recorder(result, path, args.fault)
    start = time.perf_counter()
    for section in sorted(args.sections, key=SECTIONS.index):
        t0 = time.perf_counter()
        if device.type == "cuda" and t0 - start + ESTIMATE_S[section] > args.budget:
            rec.put(section, None, {"skipped": f"estimated {ESTIMATE_S[section]} s would end past the "
                                               f"{args.budget:.0f} s budget at {t0 - start:.0f} s"})
            print(f"{section}: skipped ({result['sections'][section]['skipped']})", flush=True)
            continue
        run_section(rec, section, args, device, data)
        rec.put(section, None, {"seconds": round(time.perf_counter() - t0, 1)})
        failed = "FAILED, " if "error" in result["sections"][section] else ""
        print(f"{section}: {failed}{result['sections'][section]['seconds']} s -> {path}", flush=True)
    result["seconds"] = {k: v.get("seconds") for k, v in result["sections"].items()}
    save(result, path)
    if rec.failed:
        print(f"error: failed: {', '.join(rec.failed)} (the rest measured; see {path})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
