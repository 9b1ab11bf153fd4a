"""Exchange-pack and repack kernels (DOP row gather/scatter, head transposes over ranks, KV
page gather/write) at >= 64 MiB payloads, as (read + write) bytes / time against the same-run
copy ceiling. Run as part of ``benchmarks/kernel_bench.py``."""

from __future__ import annotations

import json

import torch
from _timing import bench  # noqa: E402  (benchmarks/ is on sys.path)

import splash.kernels_triton as K

D, PAGE = 576, 64  # latent row width L + R of DeepSeek-V3 and the GPU page size, as kernel_bench.py


def copy_records(dev, ceil) -> list[dict]:
    """Every copy benchmark, one record each."""
    out = []
    gen = torch.Generator(device=dev).manual_seed(2)

    def record(name, moved_bytes, ms, **extra):
        rec = {"kernel": name, "dtype": "bf16", "MiB": round(moved_bytes / 2**20, 1),
               "ms": round(ms, 4), "effective_GBps": round(2 * moved_bytes / ms / 1e6, 1),
               "ceiling_copy_GBps": round(ceil["copy_GBps"], 1),
               "pct_copy": round(100 * 2 * moved_bytes / ms / 1e6 / ceil["copy_GBps"], 1), **extra}
        out.append(rec)
        print(json.dumps(rec), flush=True)

    _exchange_copies(dev, gen, record)
    torch.cuda.empty_cache()
    _repack_copies(dev, gen, record)
    return out


def _exchange_copies(dev, gen, record) -> None:
    """DOP pack/unpack: 8192 rows x 16 heads x 576 bf16 (144 MiB); head transposes of
    2048 rows x 128 heads x 576 over T=8 (288 MiB)."""
    x = torch.randn(8192, 16, D, device=dev, dtype=torch.bfloat16, generator=gen)
    index = torch.randperm(8192, device=dev, generator=gen)
    y = torch.empty_like(x)
    nbytes = x.numel() * 2
    record("gather_rows", nbytes, bench(lambda: K.gather_rows(x, index)), rows=8192, row_shape=[16, D])
    record("scatter_rows", nbytes, bench(lambda: K.scatter_rows(y, index, x)), rows=8192, row_shape=[16, D])
    record("torch_index_select", nbytes, bench(lambda: x.index_select(0, index)), note="torch baseline")
    z = torch.randn(2048, 128, D, device=dev, dtype=torch.bfloat16, generator=gen)
    zs = K.split_heads_to_ranks(z, 8)
    zbytes = z.numel() * 2
    record("split_heads_to_ranks", zbytes, bench(lambda: K.split_heads_to_ranks(z, 8)), T=8, shape=[2048, 128, D])
    record("merge_heads_from_ranks", zbytes, bench(lambda: K.merge_heads_from_ranks(zs, 8)), T=8, shape=[2048, 128, D])


def _repack_copies(dev, gen, record) -> None:
    """Repack: 131072 random slots of a 4096-page pool (144 MiB of bf16 rows, 72 MiB fp8)."""
    kv = torch.randn(4096, PAGE, D, device=dev, dtype=torch.bfloat16, generator=gen)
    slots = torch.randperm(4096 * PAGE, device=dev, generator=gen)[:131072]
    rows = K.kv_gather(kv, slots)
    nbytes = rows.numel() * 2
    record("kv_gather", nbytes, bench(lambda: K.kv_gather(kv, slots)), rows=131072)
    record("kv_write", nbytes, bench(lambda: K.kv_write(kv, rows, slots)), rows=131072)
    kv8 = torch.zeros(4096, PAGE, D, device=dev, dtype=torch.float8_e4m3fn)
    s8 = torch.zeros(4096, PAGE, device=dev)
    record("kv_write_quantise_fp8", rows.numel() * 1.5 + 131072 * 4,
           bench(lambda: K.kv_write(kv8, rows, slots, s8)), rows=131072,
           note="reads bf16 rows, writes fp8 rows + scales; MiB = (read + written) / 2")
    data, scales = K.kv_gather(kv8, slots, s8)
    record("kv_gather_fp8", data.numel() + 131072 * 4, bench(lambda: K.kv_gather(kv8, slots, s8)), rows=131072)
    record("kv_write_raw_fp8", data.numel() + 131072 * 4,
           bench(lambda: K.kv_write(kv8, data, slots, s8, row_scales=scales)), rows=131072)
