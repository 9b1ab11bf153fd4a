"""Absorbed MLA prefill records (``mla_extend``, 128 heads, one 8K chunk at prefix 0 and 24K),
then the expanded form serving takes for such chunks (``expanded_prefill.py``). Run as part of
``benchmarks/kernel_bench.py``."""

from __future__ import annotations

import json
from typing import Any

import expanded_prefill  # noqa: E402  (benchmarks/ is on sys.path)
import torch
from _paged import SM_SCALE, D, L, paged_pool  # noqa: E402
from _timing import bench_both  # noqa: E402

import splash.kernels_triton as K


def _extend_ms(dev, gen, kind, heads, rows, prefix, cfg=None) -> dict[str, Any]:
    length = prefix + rows
    kv, scale, table = paged_pool(1, length, kind, dev, gen)
    q = torch.randn(rows, heads, D, device=dev, dtype=torch.bfloat16, generator=gen)
    lens = torch.tensor([length], dtype=torch.int32, device=dev)
    starts = torch.tensor([0, rows], dtype=torch.int32, device=dev)
    return bench_both(lambda: K.mla_extend(q, kv, table, lens, starts, SM_SCALE, L, kv_scale=scale,
                                           config=cfg), rep=40)


def extend_records(dev, ceil) -> list[dict]:
    """Defaults; at prefix 0 also producer/consumer warps for the KV loop (``warp_specialize``)
    and fp8 KV with fp16 products (``fp8_fp16``; off by default, measured slower here)."""
    out = []
    gen = torch.Generator(device=dev).manual_seed(1)
    heads, rows = 128, 8192
    runs = {0: [("bf16", None), ("bf16", {"warp_specialize": True}), ("fp8", None),
                ("fp8", {"fp8_fp16": True})],
            24576: [("bf16", None), ("fp8", None)]}
    for prefix in (0, 24576):
        for kind, cfg in runs[prefix]:
            times = _extend_ms(dev, gen, kind, heads, rows, prefix, cfg)
            ms = times["ms"]
            visible = rows * prefix + rows * (rows + 1) // 2  # causal (query, key) pairs
            flops = 2 * heads * (D + L) * visible
            rec = {
                "kernel": "mla_extend", "heads": heads, "batch": 1, "context": prefix + rows,
                "chunk": rows, "prefix": prefix, "dtype": kind, "config": cfg or "default",
                "ms": round(ms, 3), "ms_eager": round(times["ms_eager"], 3),
                "TFLOPs": round(flops / ms / 1e9, 1),
                "ceiling_matmul_TFLOPs": round(ceil["matmul_TFLOPs"], 1),
                "pct_matmul": round(100 * flops / ms / 1e9 / ceil["matmul_TFLOPs"], 1),
                "ceiling_copy_GBps": round(ceil["copy_GBps"], 1),
            }
            out.append(rec)
            print(json.dumps(rec), flush=True)
    out += expanded_prefill.records(heads, rows, (0, 24576), ceil)  # as serving runs it
    return out
