"""The GPU check's preflight (scripts/bench/gpu_bench.py runs it in its own process right after the
install, before any timing): every import the sections use, /dev/shm against what the end-to-end
loaders will hold, one ``decode_jpeg`` on the device and one process-group start. Each check is one
line in gpu.json's ``preflight``: ``ok: ...`` or ``error: ...`` (the measurements still run)."""

from __future__ import annotations

import importlib
import shutil
import socket
import time

# what every section imports (the machine's or the bundle's), and what some add
IMPORTS = ("torch", "torchvision", "torchvision.io", "PIL", "numpy", "accelerate", "transformers", "open_clip",
           "webdataset", "pydantic", "sklearn", "skimage", "safetensors", "mmpretrain.train",
           "mmpretrain.data.device_decode", "mmpretrain.testing.photos")
SECTION_IMPORTS = {"step": ("open_clip_train.data", "pandas"), "engines": ("deepspeed",)}


def preflight(args, device) -> dict:
    names = [*IMPORTS, *(m for s in args.sections for m in SECTION_IMPORTS.get(s, ()))]
    if "engines" in args.sections and "deepspeed" not in args.engines:
        names.remove("deepspeed")
    return {"imports": check(imports, names), "shm": check(shm, args), "decode_jpeg": check(decode_jpeg, device),
            "process_group": check(process_group, device)}


def check(fn, *a) -> str:
    try:
        return f"ok: {fn(*a)}"
    except Exception as e:  # one line: what failed
        return f"error: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def imports(names: list[str]) -> str:
    bad = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:
            bad.append(f"{name} ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})")
    if bad:
        raise ImportError("; ".join(bad))
    return f"{len(names)} modules"


def shm(args) -> str:
    """The largest end-to-end side's loader: W workers x 2 prefetched + 2 batches in /dev/shm, open_clip's
    float batches (4 bytes a pixel) being the largest."""
    from gpu_end_to_end import PREFETCH, e2e_workers

    from mmpretrain.data.host_memory import SHM, shm_bytes

    workers = e2e_workers(args)
    batch = args.batch_size * 3 * 224 * 224 * 4 + args.batch_size * 77 * 8
    need = shm_bytes(batch, workers, PREFETCH)
    free = shutil.disk_usage(SHM).free
    line = f"{SHM} {free / 2**30:.2f} GiB free, the loaders hold up to {need / 2**30:.2f} GiB"
    if free < need:
        raise OSError(line + " (the end-to-end sides will die of a bus error: --e2e-workers or --batch-size lower)")
    return line


def decode_jpeg(device) -> str:
    import torch
    import torchvision.io as tio

    from mmpretrain.data.device_decode import nvjpeg_backend
    from mmpretrain.testing.photos import make_jpegs

    jpg = make_jpegs(1, seed=0)[0][1]
    data = torch.frombuffer(bytearray(jpg), dtype=torch.uint8)
    t0 = time.perf_counter()
    img = tio.decode_jpeg(data, mode=tio.ImageReadMode.RGB, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (f"{tuple(img.shape)} on {img.device} in {(time.perf_counter() - t0) * 1e3:.0f} ms (first call); "
            f"nvJPEG backend: {nvjpeg_backend(device)}")


def process_group(device) -> str:
    """One rank's process group on a free local port (NCCL on CUDA, gloo on a CPU) and one all-reduce."""
    import torch
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        x = torch.ones(1, device=device)
        dist.all_reduce(x)
        assert float(x) == 1.0
    finally:
        dist.destroy_process_group()
    return f"{backend}, 1 rank, all_reduce in {(time.perf_counter() - t0) * 1e3:.0f} ms"
