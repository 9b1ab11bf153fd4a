"""Small drivers for Nsight Compute (``benchmarks/profile_kernels.sh``), and the summariser of its
CSV exports.

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
import csv
import glob
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
    "dsa_sparse_128h_16x2k": ("^_mla_decode_heads", 1,
                              "mla_sparse 16 rows x 128 heads over 2048 chosen bf16 latent rows "
                              "(on Hopper the many-head Gluon decode kernel, rows by cp.async)"),
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

    per_tile = {"gather_pages": False, "num_stages": 2} if case.endswith("_ids") else None

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
    heads = 128 if "_128h_" in case else 16
    q = torch.randn(batch, heads, D, device=dev, dtype=torch.bfloat16, generator=gen)
    return lambda: K.mla_sparse(q, kv, slots, SM_SCALE, L)


def kernel_info() -> list[dict[str, Any]]:
    """Registers and local-memory bytes per thread of the compiled Triton kernels (best effort:
    the JIT cache layout differs across Triton versions)."""
    import importlib

    # by module path: the package's own names for some of these modules are its functions
    mods = {m: importlib.import_module(f"splash.kernels_triton.{m}") for m in
            ("fused_moe", "mla_decode_kernels", "mla_decode_tokens_m", "mla_extend")}
    out = []
    fns = [mods["mla_decode_kernels"]._mla_decode_kernel,
           mods["mla_decode_tokens_m"]._mla_decode_tokens_m_kernel,
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


# ---------------------------------------------------------------------------------------------
# summariser

# (label, [(section substring or "", metric name)]) — the first match wins
_WANTED: list[tuple[str, list[tuple[str, str]]]] = [
    ("duration", [("Speed Of Light", "Duration")]),
    ("sm_throughput_pct", [("Speed Of Light", "Compute (SM) Throughput")]),
    ("memory_throughput_pct", [("Speed Of Light", "Memory Throughput")]),
    ("dram_throughput_pct", [("Speed Of Light", "DRAM Throughput")]),
    ("dram_bytes_per_s", [("", "dram__bytes.sum.per_second"),
                          ("Memory Workload", "Memory Throughput")]),
    ("achieved_occupancy_pct", [("Occupancy", "Achieved Occupancy")]),
    ("theoretical_occupancy_pct", [("Occupancy", "Theoretical Occupancy")]),
    ("registers_per_thread", [("Launch", "Registers Per Thread")]),
    ("shared_mem_per_block", [("Launch", "Dynamic Shared Memory Per Block")]),
    ("grid_size", [("Launch", "Grid Size")]),
    ("waves_per_sm", [("Launch", "Waves Per SM")]),
    ("local_load_bytes", [("", "l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum")]),
    ("local_store_bytes", [("", "l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum")]),
    ("tensor_pipe_pct", [
        ("", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"),
        ("", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"),
    ]),
    ("l2_hit_pct", [("Memory Workload", "L2 Hit Rate")]),
    ("issue_slots_busy_pct", [("Compute Workload", "Issue Slots Busy")]),
    ("warp_cycles_per_issue", [("Warp State", "Warp Cycles Per Issued Instruction")]),
]
_SCALE = {  # unit -> factor to the base unit (seconds, bytes, bytes/s)
    "nsecond": 1e-9, "ns": 1e-9, "usecond": 1e-6, "us": 1e-6, "msecond": 1e-3, "ms": 1e-3,
    "second": 1.0, "s": 1.0,
    "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12,
    "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
    "byte/second": 1.0, "Kbyte/second": 1e3, "Mbyte/second": 1e6, "Gbyte/second": 1e9,
    "Tbyte/second": 1e12, "byte/s": 1.0, "Kbyte/s": 1e3, "Mbyte/s": 1e6, "Gbyte/s": 1e9,
    "Tbyte/s": 1e12, "B/s": 1.0, "KB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12,
}


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def _read_details(path: str) -> list[dict[str, str]]:
    """Rows of an ``ncu --csv --page details`` export (lines before the header skipped)."""
    with open(path, newline="", errors="replace") as f:
        lines = f.readlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return []
    return list(csv.DictReader(lines[start:]))


def summarise_csv(case: str, path: str) -> list[dict[str, Any]]:
    """One dict per profiled launch of ``path``: the wanted metrics (durations in ms, rates in
    GB/s, byte counts in bytes)."""
    launches: dict[str, dict[str, Any]] = {}
    metrics: dict[str, dict[tuple[str, str], tuple[str, str]]] = {}
    for row in _read_details(path):
        lid = row.get("ID", "?")
        if lid not in launches:
            launches[lid] = {"case": case, "launch": lid,
                             "kernel": (row.get("Kernel Name") or "")[:60],
                             "grid": row.get("Grid Size"), "block": row.get("Block Size")}
            metrics[lid] = {}
        key = (row.get("Section Name") or "", row.get("Metric Name") or "")
        metrics[lid][key] = (row.get("Metric Unit") or "", row.get("Metric Value") or "")
    out = []
    for lid, rec in launches.items():
        found = metrics[lid]
        for label, options in _WANTED:
            for section, name in options:
                hit = next(((u, v) for (s, n), (u, v) in found.items()
                            if n == name and section in s), None)
                if hit is None:
                    continue
                unit, value = hit
                num = _number(value)
                if num is None:
                    rec[label] = value
                elif label == "duration":
                    rec["duration_ms"] = round(num * _SCALE.get(unit, 1e-9) * 1e3, 4)
                elif label == "dram_bytes_per_s":
                    rec["dram_GBps"] = round(num * _SCALE.get(unit, 1.0) / 1e9, 1)
                else:
                    rec[label] = num
                break
        stalls = {n.split("issue_stalled_")[1].split("_per_issue")[0]: _number(v)
                  for (_, n), (_, v) in found.items() if "issue_stalled_" in n}
        if stalls:  # cycles each issued instruction waited, by reason, largest first
            rec["stalls"] = dict(sorted(((k, v) for k, v in stalls.items() if v is not None),
                                        key=lambda kv: -kv[1]))
        out.append(rec)
    return out


def summarise(outdir: str) -> None:
    records: list[dict[str, Any]] = []
    notes: list[str] = []
    for path in sorted(glob.glob(os.path.join(outdir, "*.csv"))):
        if path.endswith(".source.csv"):  # the source page: stall_sites.py's input
            continue
        case = os.path.basename(path)[: -len(".csv")]
        rows = summarise_csv(case, path)
        if not rows:
            notes.append(f"{case}: no ncu rows in {os.path.basename(path)}")
        records += rows
    for path in sorted(glob.glob(os.path.join(outdir, "*.log"))):
        case = os.path.basename(path)[: -len(".log")]
        with open(path, errors="replace") as f:
            for line in f:
                for tag in ("KERNEL_INFO", "TIMING"):
                    if line.startswith(tag + " "):
                        try:
                            records.append({"tag": tag.lower(), **json.loads(line[len(tag) + 1:])})
                        except json.JSONDecodeError:
                            pass
                if line.startswith("CASE_STATUS "):
                    notes.append(line.strip()[len("CASE_STATUS "):])
    cols = ["duration_ms", "sm_throughput_pct", "memory_throughput_pct", "dram_GBps",
            "achieved_occupancy_pct", "registers_per_thread", "local_load_bytes",
            "local_store_bytes", "tensor_pipe_pct"]
    short = ["ms", "SM%", "mem%", "DRAM GB/s", "occ%", "regs", "local ld B", "local st B",
             "tensor%"]
    lines = ["# Nsight Compute summary (one row per profiled launch)", "",
             "case | launch | kernel | grid | " + " | ".join(short)]
    for rec in records:
        if "tag" in rec:
            continue
        vals = [rec.get(c, "-") for c in cols]
        lines.append(" | ".join(str(x) for x in
                                [rec["case"], rec["launch"], rec["kernel"], rec["grid"], *vals]))
    stalled = [r for r in records if "stalls" in r]
    if stalled:
        lines += ["", "# warp stalls (cycles per issued instruction, by reason)"]
        lines += [f"{r['case']} | {r['launch']} | "
                  + ", ".join(f"{k} {v:.2f}" for k, v in list(r["stalls"].items())[:6])
                  for r in stalled]
    sites: dict[str, Any] = {}
    for path in sorted(glob.glob(os.path.join(outdir, "*.stalls.json"))):
        with open(path) as f:
            sites[os.path.basename(path)[: -len(".stalls.json")]] = json.load(f)
    if sites:  # stall_sites.py's: where the samples sit
        lines += ["", "# warp-stall samples (% of a kernel's; reasons, then opcodes)"]
        lines += [f"{c} | " + ", ".join(f"{k} {v}" for k, v in list(s.get("by_reason_pct",
                  {}).items())[:5]) + " | " + ", ".join(f"{k} {v}" for k, v in list(
                  s.get("by_opcode_pct", {}).items())[:5]) for c, s in sites.items()]
    infos = [r for r in records if r.get("tag") == "kernel_info"]
    if infos:
        lines += ["", "# compiled Triton kernels (registers, local-memory = spill bytes per "
                      "thread)"]
        for r in infos:
            lines.append(json.dumps({k: v for k, v in r.items() if k != "tag"}))
    timings = [r for r in records if r.get("tag") == "timing"]
    if timings:
        lines += ["", "# timings without ncu (CUDA-graph / eager medians, ms)"]
        lines += [json.dumps({k: v for k, v in r.items() if k != "tag"}) for r in timings]
    if notes:
        lines += ["", "# notes", *notes]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(outdir, "summary.txt"), "w") as f:
        f.write(text)
    with open(os.path.join(outdir, "summary.json"), "w") as f:
        json.dump({"records": records, "stall_sites": sites, "notes": notes}, f, indent=1)
    print(text)


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
        summarise(args.summarise)
        return
    if not args.case:
        parser.error("a case, --list or --summarise")
    if args.case not in CASES:
        sys.exit(f"unknown case {args.case!r}; cases: {', '.join(CASES)}")
    run_case(args.case, args.time)


if __name__ == "__main__":
    main()
