"""Small drivers for Nsight Compute (``benchmarks/profile_kernels.sh``); ``--summarise`` runs
the summariser of its CSV exports (``ncu_summary.py``).

    python benchmarks/profile_driver.py CASE [--time]      # run one case (under ncu)
    python benchmarks/profile_driver.py --list              # case, kernel regex, launches per call
    python benchmarks/profile_driver.py --summarise OUTDIR  # OUTDIR/*.csv -> summary.txt/.json

A case builds its inputs, then calls the kernel ``WARM + 1`` times: the script tells ncu to skip
the ``WARM * launches`` matching launches of the warm-up (compilation included) and profile the
next ``launches``. ``--time`` (the fallback when ncu is missing or not permitted) prints the
CUDA-graph and eager medians instead. Each run prints one ``KERNEL_INFO`` JSON line per compiled
Triton kernel it can find (registers and local-memory bytes per thread, from the compiler).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

WARM = 3
L, R, PAGE = 512, 64, 64
D = L + R
SM_SCALE = 0.1147

# case -> (kernel-name regex for ncu, matching launches per call, description)
CASES: dict[str, tuple[str, int, str]] = {
    "decode_bf16_16h_64x4k": ("^_mla_decode", 1, "mla_decode 16 heads, 64 x 4K, bf16 KV"),
    "decode_fp8_16h_64x32k": ("^_mla_decode", 1,
                              "mla_decode 16 heads, 64 x 32K, fp8 KV (defaults: on Hopper the "
                              "Gluon kernel, mla_decode_tokens_fp8)"),
    "decode_fp8_16h_64x4k": ("^_mla_decode", 1, "mla_decode 16 heads, 64 x 4K, fp8 KV (defaults)"),
    "decode_fp8_16h_64x32k_bf16prod": ("^_mla_decode", 1,
                                       "mla_decode 16 heads, 64 x 32K, fp8 KV, fp8_fp16 off"),
    "decode_bf16_128h_8x32k": ("^_mla_decode", 1, "mla_decode 128 heads, 8 x 32K, bf16 KV"),
    "decode_fp8_128h_8x32k": ("^_mla_decode", 1, "mla_decode 128 heads, 8 x 32K, fp8 KV"),
    "extend_bf16_128h_4k_p0": ("^_mla_extend", 1,
                               "mla_extend 4096 rows x 128 heads, prefix 0, bf16"),
    "moe_bf16_v2lite_4k": ("^_moe_gemm", 2,
                           "fused_moe V2-Lite experts (64 x 2048 x 1408, top-6), 4096 tokens, "
                           "bf16: gate_up then down GEMM"),
    "dsa_index_16x128k": ("^_index_scores", 1,
                          "index_scores 16 decode rows x 128K, 64 index heads of 128, fp8 keys"),
    "dsa_index_16x128k_ids": ("^_index_scores", 1, "the same with page ids loaded per tile, 2 "
                              "stages"),
    "decode_fp8_16h_64x32k_ids": ("^_mla_decode", 1, "mla_decode 16 heads, 64 x 32K, fp8 KV, "
                                  "page ids loaded per tile on 32-token tiles"),
    "dsa_topk_16x128k": ("^_topk_", 6, "topk_rows 16 rows x 128K scores, k 2048, no floor "
                         "(three passes: search, place)"),
    "dsa_topk_16x128k_floor": ("^_topk_", 3, "the same with the indexer group maxima as the "
                               "engine runs it (the floor pass, then the last in one launch)"),
    "dsa_sparse_16h_16x2k": ("^_mla_sparse", 1,
                             "mla_sparse 16 rows x 16 heads over 2048 chosen bf16 latent rows"),
    "dsa_sparse_128h_16x2k": ("^_mla_decode_heads", 1, "the same at 128 heads (on Hopper the "
                              "many-head Gluon decode kernel, rows by cp.async)"),
}


def _paged(batch: int, context: int, fp8: bool, dev, gen):
    from _paged import paged_pool  # benchmarks/_paged.py (this folder is on sys.path)

    return paged_pool(batch, context, "fp8" if fp8 else "bf16", dev, gen)


def build(case: str) -> Callable[[], Any]:
    """The call a case profiles (inputs allocated once)."""
    import torch

    import splash.kernels_triton as K

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    if case.startswith("decode_"):
        fp8 = "_fp8_" in case
        heads, batch, context = {
            "decode_bf16_16h_64x4k": (16, 64, 4096),
            "decode_fp8_16h_64x32k": (16, 64, 32768),
            "decode_fp8_16h_64x4k": (16, 64, 4096),
            "decode_fp8_16h_64x32k_bf16prod": (16, 64, 32768),
            "decode_fp8_16h_64x32k_ids": (16, 64, 32768),
            "decode_bf16_128h_8x32k": (128, 8, 32768),
            "decode_fp8_128h_8x32k": (128, 8, 32768),
        }[case]
        cfg = {"fp8_fp16": False} if case.endswith("_bf16prod") else None
        if case.endswith("_ids"):
            cfg = {"gather_pages": False, "BLOCK_N": 32}
        # SPLASH_PROFILE_CONFIG (a JSON object): config entries over the case's, for A/Bs
        cfg = {**(cfg or {}), **json.loads(os.environ.get("SPLASH_PROFILE_CONFIG", "{}"))} or None
        kv, scale, table = _paged(batch, context, fp8, dev, gen)
        q = torch.randn(batch, heads, D, device=dev, dtype=torch.bfloat16, generator=gen)
        lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
        return lambda: K.mla_decode(q, kv, table, lens, SM_SCALE, L, kv_scale=scale, config=cfg)
    if case == "extend_bf16_128h_4k_p0":
        rows, heads = 4096, 128
        kv, scale, table = _paged(1, rows, False, dev, gen)
        q = torch.randn(rows, heads, D, device=dev, dtype=torch.bfloat16, generator=gen)
        lens = torch.tensor([rows], dtype=torch.int32, device=dev)
        starts = torch.tensor([0, rows], dtype=torch.int32, device=dev)
        return lambda: K.mla_extend(q, kv, table, lens, starts, SM_SCALE, L, kv_scale=scale)
    if case == "moe_bf16_v2lite_4k":
        experts, hidden, inter, topk, tokens = 64, 2048, 1408, 6, 4096
        x = torch.randn(tokens, hidden, device=dev, generator=gen).bfloat16()
        w13 = (torch.randn(experts, 2 * inter, hidden, device=dev, generator=gen)
               / hidden**0.5).bfloat16()
        w2 = (torch.randn(experts, hidden, inter, device=dev, generator=gen)
              / inter**0.5).bfloat16()
        top = torch.randn(tokens, experts, device=dev, generator=gen).topk(topk, dim=-1)
        weights = torch.softmax(top.values, dim=-1).float()
        ids = top.indices.to(torch.int32)
        return lambda: K.fused_moe(x, w13, w2, weights, ids)
    if case.startswith("dsa_"):
        return _dsa(case, dev, gen)
    raise SystemExit(f"unknown case {case!r}; cases: {', '.join(CASES)}")


def _dsa(case: str, dev, gen) -> Callable[[], Any]:
    """DSA decode stages at benchmarks/dsa_kernels.py's shapes (batch 16, 128K history)."""
    import torch
    from dsa_kernels import INDEX_DIM, INDEX_HEADS, TOPK, _pools

    import splash.kernels_triton as K

    batch, context = 16, 131072
    kv, scale, keys, key_scale, table = _pools(batch, context, "bf16", dev, gen)
    lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    starts = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    iq = torch.randn(batch, INDEX_HEADS, INDEX_DIM, device=dev, dtype=torch.bfloat16,
                     generator=gen)
    w = torch.randn(batch, INDEX_HEADS, device=dev, generator=gen) * INDEX_HEADS ** -0.5
    # (_ids: the Triton kernel with page ids loaded per tile, not the Gluon one)
    per_tile = ({"gather_pages": False, "num_stages": 2, "gluon": False}
                if case.endswith("_ids") else None)

    def scores():
        return K.index_scores(iq, w, keys, table, lens, starts, INDEX_DIM ** -0.5, context,
                              index_scale=key_scale, config=per_tile, max_rows=1)

    if case.startswith("dsa_index_"):
        return scores
    s = scores()
    if case == "dsa_topk_16x128k":
        return lambda: K.topk_rows(s, TOPK, block_table=table, page_size=PAGE)
    if case == "dsa_topk_16x128k_floor":
        gmax = s.view(batch, -1, 8).amax(2)  # what index_scores(group_max=) writes
        return lambda: K.topk_rows(s, TOPK, block_table=table, page_size=PAGE, floor_max=gmax)
    slots = K.topk_rows(s, TOPK, block_table=table, page_size=PAGE)[1]
    q = torch.randn(batch, 128 if "_128h_" in case else 16, D, device=dev, dtype=torch.bfloat16,
                    generator=gen)
    return lambda: K.mla_sparse(q, kv, slots, SM_SCALE, L)


def kernel_info() -> list[dict[str, Any]]:
    """Registers and local-memory bytes per thread of the compiled Triton kernels (best effort:
    the JIT cache layout differs across Triton versions)."""
    import importlib

    # by module path: the package's own names for some of these modules are its functions
    mods = {m: importlib.import_module(f"splash.kernels_triton.{m}") for m in
            ("fused_moe", "mla_decode_kernels", "mla_decode_chunked", "mla_extend")}
    out = []
    fns = [mods["mla_decode_kernels"]._mla_decode_kernel,
           mods["mla_decode_chunked"]._mla_decode_chunked_kernel,
           mods["mla_extend"]._mla_extend_kernel, mods["fused_moe"]._moe_gemm_kernel]
    for fn in fns:
        caches = getattr(fn, "device_caches", None) or getattr(fn, "cache", None) or {}
        for entry in caches.values():
            kernels = entry[0] if isinstance(entry, tuple) else entry
            if not isinstance(kernels, dict):
                continue
            for compiled in kernels.values():
                try:
                    if hasattr(compiled, "_init_handles"):
                        compiled._init_handles()
                    out.append({"kernel": fn.__name__, "n_regs": int(compiled.n_regs),
                                "local_bytes_per_thread": int(compiled.n_spills),
                                "num_warps": compiled.metadata.num_warps,
                                "num_stages": compiled.metadata.num_stages,
                                "shared_bytes": compiled.metadata.shared})
                except Exception as exc:  # noqa: BLE001 - informative only
                    out.append({"kernel": fn.__name__, "error": repr(exc)[:120]})
    return out


def run_case(case: str, time_it: bool) -> None:
    import torch

    import splash.kernels_triton as K

    K.set_value_checks(False)
    fn = build(case)
    for _ in range(WARM):
        fn()
    torch.cuda.synchronize()
    fn()  # the profiled call
    torch.cuda.synchronize()
    for info in kernel_info():
        print("KERNEL_INFO", json.dumps({"case": case, **info}), flush=True)
    if time_it:
        from triton.testing import do_bench, do_bench_cudagraph

        graph = float(do_bench_cudagraph(fn, rep=20, return_mode="median"))
        eager = float(do_bench(fn, warmup=10, rep=40, return_mode="median"))
        print("TIMING", json.dumps({"case": case, "ms": graph, "ms_eager": eager}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", nargs="?")
    parser.add_argument("--time", action="store_true", help="print timings (no ncu)")
    parser.add_argument("--list", action="store_true", help="case regex launches description")
    parser.add_argument("--summarise", metavar="OUTDIR")
    args = parser.parse_args()
    if args.list:
        for case, (regex, launches, desc) in CASES.items():
            print(case, regex, launches, desc.replace(" ", "_"))
        return
    if args.summarise:
        from ncu_summary import summarise  # noqa: E402  (benchmarks/ is on sys.path)

        summarise(args.summarise)
        return
    if not args.case:
        parser.error("a case, --list or --summarise")
    if args.case not in CASES:
        sys.exit(f"unknown case {args.case!r}; cases: {', '.join(CASES)}")
    run_case(args.case, args.time)


if __name__ == "__main__":
    main()
