"""Timing helpers and same-run ceilings shared by the GPU benchmarks."""

from __future__ import annotations

from typing import Any

import torch
from triton.testing import do_bench, do_bench_cudagraph


def bench(fn, rep: int = 60, warmup: int = 15) -> float:
    """Eager median (ms), L2 flushed between repetitions."""
    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def bench_both(fn, rep: int = 30) -> dict[str, Any]:
    """``{"ms": CUDA-graph median, "ms_eager": eager median}`` (ms). The eager run comes first and
    doubles as the warm-up (compilation, allocator pools), so the capture only records launches;
    a failed capture leaves ``ms`` = the eager time and ``graph_error``."""
    eager = bench(fn, rep=rep)
    out: dict[str, Any] = {"ms_eager": eager}
    try:
        fn()
        torch.cuda.synchronize()
        out["ms"] = float(do_bench_cudagraph(fn, rep=max(10, rep // 2), return_mode="median"))
    except Exception as exc:  # noqa: BLE001 - report and keep the eager figure
        torch.cuda.synchronize()
        out["ms"] = eager
        out["graph_error"] = repr(exc)[:300]
    return out


def captured(fn, replays: int = 200) -> tuple[torch.cuda.CUDAGraph, float]:
    """``fn`` warmed up, captured in a CUDA graph on a side stream, and the graph's mean replay
    time (ms, timed with events over ``replays`` replays after 20 untimed ones)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        fn()
    for _ in range(20):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return graph, start.elapsed_time(end) / replays


def matmul_peak(dev: torch.device, rep: int = 60, graph: bool = False) -> float:
    """bf16 8192^3 torch matmul TFLOP/s: eager (L2 flushed between repetitions), or with
    ``graph`` replayed back to back in a CUDA graph, as graph-timed kernels run (sustained
    load, no gaps: the clocks a graph-timed kernel meets)."""
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    if graph:
        a @ b
        ms = float(do_bench_cudagraph(lambda: a @ b, rep=rep, return_mode="median"))
    else:
        ms = bench(lambda: a @ b, rep=rep)
    return 2 * 8192**3 / ms / 1e9


def ceilings(dev: torch.device) -> dict[str, float]:
    """Device copy bandwidth (read + write of a 2 GiB clone) and the bf16 matmul peak."""
    x = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
    copy_ms = bench(x.clone)
    del x
    return {"copy_GBps": 2 * (2 << 30) / copy_ms / 1e6, "matmul_TFLOPs": matmul_peak(dev)}
