"""`splash calibrate`: measure this machine's hardware profile for the cost model.

Measures the dense matmul rate (bf16 on a GPU, fp32 on the CPU), device memory bandwidth (a large
tensor copy: read + write bytes), and, with ``--tp`` > 1, all-gather bus bandwidth and latency over
a real process group (``--tp`` spawned processes; nccl on GPUs, gloo on the CPU or when there
are fewer GPUs than ranks). Writes the fields of `HardwareProfile` (plus what was measured) as
JSON to ``--out`` (default: $SPLASH_CACHE_DIR/calibration/<profile>-tp<T>.json) and prints it;
`load_profile(name, path)` or SPLASH_CALIBRATION then override the spec figures with it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from splash import envs
from splash.backends import get_backend
from splash.dist.rendezvous import host_store, join_group

SIZES = {  # (matmul n, copy bytes, all-gather bytes per rank)
    "cuda": (8192, 1 << 30, (8 << 10, 4 << 20, 64 << 20)),
    "cpu": (1024, 256 << 20, (8 << 10, 1 << 20, 8 << 20)),
    "quick": (256, 8 << 20, (4 << 10, 256 << 10)),
}


def _timed(fn, sync, min_s: float, warmup: int = 2, iters: int | None = None) -> float:
    """Seconds per call of ``fn``: median of repeated timings lasting ``min_s`` in all, or of
    exactly ``iters`` calls (collectives: every rank must make the same number of calls)."""
    for _ in range(warmup):
        fn()
    sync()
    times: list[float] = []
    start = time.perf_counter()
    while not times or (len(times) < iters if iters else
                        time.perf_counter() - start < min_s and len(times) < 50):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def measure_device(device: torch.device, quick: bool = False) -> dict[str, Any]:
    """Matmul TFLOP/s and copy GB/s (read + write) on ``device``."""
    gpu = device.type == "cuda"
    n, copy_bytes, _ = SIZES["quick" if quick else ("cuda" if gpu else "cpu")]
    dtype = torch.bfloat16 if gpu else torch.float32
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    min_s = 0.05 if quick else 0.3
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t_mm = _timed(lambda: torch.mm(a, b), sync, min_s)
    src = torch.empty(copy_bytes // 4, device=device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    t_cp = _timed(lambda: dst.copy_(src), sync, min_s)
    return {"matmul_tflops": 2 * n**3 / t_mm / 1e12, "matmul_dtype": str(dtype).split(".")[-1],
            "copy_gbps": 2 * copy_bytes / t_cp / 1e9}


def _collective_worker(rank: int, world: int, init: str, backend: str, sizes, quick: bool,
                       queue) -> None:
    import torch.distributed as dist

    join_group(backend, init, rank, world)
    try:
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if backend == "nccl":
            torch.cuda.set_device(device)
        sync = torch.cuda.synchronize if backend == "nccl" else (lambda: None)
        results = {}
        for nbytes in sizes:
            x = torch.ones(max(nbytes // 4, 1), device=device)
            outs = [torch.empty_like(x) for _ in range(world)]

            def gather(x=x, outs=outs) -> None:
                dist.all_gather(outs, x)

            dist.barrier()
            t = _timed(gather, sync, 0.0, iters=5 if quick else 20)
            t_max = torch.tensor([t], dtype=torch.float64, device=device)
            dist.all_reduce(t_max, op=dist.ReduceOp.MAX)  # the slowest rank sets the time
            results[nbytes] = float(t_max.item())
        if rank == 0:
            queue.put(results)
    finally:
        dist.destroy_process_group()


def measure_collectives(world: int, backend: str, quick: bool = False) -> dict[str, Any]:
    """All-gather bus bandwidth (GB/s) and small-message latency (µs) over ``world`` processes."""
    import torch.multiprocessing as mp

    sizes = SIZES["quick" if quick else ("cuda" if backend == "nccl" else "cpu")][2]
    store, init = host_store()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_collective_worker, args=(world, init, backend, sizes, quick, queue),
                       nprocs=world, join=True, start_method="spawn")
    del store
    times = queue.get()
    busbw = max((world - 1) / world * world * n / t / 1e9 for n, t in times.items())
    return {"allgather_busbw_gbps": busbw, "allgather_latency_us": times[min(times)] * 1e6,
            "collective_backend": backend, "allgather_seconds": {str(k): v for k, v in
                                                                  times.items()}}


def calibrate(backend_name: str = "auto", tp: int = 1, quick: bool = False) -> dict:
    """Measure and return a profile dict (HardwareProfile fields + ``measured``)."""
    backend = get_backend(backend_name)
    spec = backend.profile
    device = backend.device(0)
    measured = measure_device(device, quick)
    gpu = device.type == "cuda"
    dist_backend = "nccl" if gpu and torch.cuda.device_count() >= tp else "gloo"
    if tp > 1:
        measured.update(measure_collectives(tp, dist_backend, quick))
    if gpu:
        memory_gib = torch.cuda.get_device_properties(device).total_memory / (1 << 30)
    else:
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    ratio = measured["matmul_tflops"] / spec.peak_bf16_tflops
    profile = dataclasses.replace(
        spec,
        peak_bf16_tflops=measured["matmul_tflops"],
        peak_fp8_tflops=spec.peak_fp8_tflops * ratio,  # fp8 not measured: keep its spec ratio
        hbm_gbps=measured["copy_gbps"],
        link_gbps=measured.get("allgather_busbw_gbps", spec.link_gbps),
        collective_latency_us=measured.get("allgather_latency_us", spec.collective_latency_us),
        memory_gib=memory_gib, source="calibrate")
    out = dataclasses.asdict(profile)
    out["measured"] = {**measured, "device": str(device), "tp": tp, "quick": quick,
                       "torch": torch.__version__}
    return out


def calibrate_main(args) -> int:
    """`splash calibrate`: write the measured profile JSON and print it."""
    quick = bool(getattr(args, "quick", False))
    result = calibrate(args.backend, args.tp_size, quick)
    out = args.out or str(Path(envs.get("SPLASH_CACHE_DIR")) / "calibration" /
                          f"{result['name']}-tp{args.tp_size}.json")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1))
    result["written_to"] = out
    print(json.dumps(result))
    return 0
