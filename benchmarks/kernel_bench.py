"""Kernel benchmark: SPLASH's Triton kernels against ceilings measured in the same run.

    python benchmarks/kernel_bench.py --out benchmarks/results/h200/kernels.json [--no-sweep]
        [--sweep-configs] [--only-decode [--merge]] [--only-dsa] [--shapes 16x64x4096,128x8x32768]
        [--kinds bf16,fp8]

Measures, on the current GPU:
- ceilings: device copy bandwidth (read + write of a large clone) and bf16 8192^3 matmul TFLOP/s;
- ``mla_decode`` on the six anchor shapes (16 heads: 64x4K, 64x32K, 16x128K; 128 heads: 8x32K,
  64x4K, 2x128K; L=512, R=64, page 64, random page order), bf16 and fp8 KV, with the launcher's
  own choices ("auto") and a small sweep of tile configs and split counts ("best"; fp8 KV with
  fp16 products, ``fp8_fp16``, on both kernels, and without it as the reference);
- ``mla_extend``: one 8K-row chunk x 128 heads, causal, prefix 0 and 24K; the same chunk in
  the expanded form (``prefill_expanded``, benchmarks/expanded_prefill.py);
- exchange / repack copies (gather_rows, scatter_rows, split/merge heads, kv_gather, kv_write)
  at >= 64 MiB, as read + write bandwidth;
- DSA decode (``dsa_kernels.py``): indexer scores, top-k, sparse MLA and the three together at
  batch 16, 16 / 128 heads, 32K / 128K, index_topk 2048, as % of the bytes roofline (indexer
  keys of the history + the selected latent rows). ``--only-dsa`` runs just these and merges
  them into an existing ``--out`` file; ``--only-decode --merge`` likewise replaces just the
  decode records of the shapes and kinds it measured (the rest of the file is kept).

Decode FLOPs are 2·H·(D + L) per KV token per query; effective bandwidth counts the KV bytes
(rows + fp8 scales) read once. Peer figures: the Triton MLA decode kernel SGLang/vLLM ship, best
split, measured on an H200 with the same image (2026-11-29; ``PEER`` below).

Timings (value checks off, so a call never syncs with the host):
- ``ms`` (the headline) is ``triton.testing.do_bench_cudagraph``'s median: the call's kernels
  (decode, plus the merge when split) captured in a CUDA graph and replayed, which is what the
  engine's CUDA-graph decode steps pay. No L2 flush, but every decode/extend shape reads far
  more KV than the 50 MB L2 holds.
- ``ms_eager`` is ``triton.testing.do_bench``'s median (L2 flushed between repetitions): one
  eager call each time, so it includes the Python launcher (argument checks, config, Triton
  launch). Where ``ms_eager`` >> ``ms`` the launcher, not the kernel, bounds the eager figure
  (the 16-head 64x4K shape: ~0.13 ms per call).
- ``ms_layer`` (defaults only) is a layer's share of one graph of ``LAYERS`` decode calls under
  one ``plan_scope``, as a forward runs them: the balanced-split plan launches once for all
  layers instead of once a call (``pct_copy_layer`` and ``TFLOPs_layer`` from it).
The warm-up runs the call eagerly first (compiles the kernels), so capture never compiles. If a
capture fails, ``ms`` falls back to the eager time and ``graph_error`` says why. The copy
benchmarks are eager only (large, bandwidth-bound).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import subprocess
import sys
from typing import Any

import torch
import triton
from _paged import PAGE, SM_SCALE, D, L, paged_pool  # noqa: E402  (benchmarks/ is on sys.path)
from _timing import bench_both, ceilings  # noqa: E402
from copy_kernels import copy_records  # noqa: E402
from decode_layers import LAYERS, layer_ms  # noqa: E402
from dsa_kernels import dsa_records, merge_dsa  # noqa: E402
from extend_kernels import extend_records  # noqa: E402

import splash.kernels_triton as K
from splash.kernels_triton.mla_decode import query_as_read

DECODE_SHAPES = [(16, 64, 4096), (16, 64, 32768), (16, 16, 131072),
                 (128, 8, 32768), (128, 64, 4096), (128, 2, 131072)]  # (heads, batch, context)

# best split of the peer kernel per shape (measured on an H200, 2026-11-29, same image)
PEER = {
    (16, 64, 4096): {"ms": 0.1281, "GBps": 2357.2},
    (16, 64, 32768): {"ms": 0.8249, "GBps": 2928.6},
    (16, 16, 131072): {"ms": 0.8278, "GBps": 2918.6},
    (128, 8, 32768): {"ms": 0.8434, "GBps": 358.1},
    (128, 64, 4096): {"ms": 0.8657, "GBps": 348.8},
    (128, 2, 131072): {"ms": 0.8591, "GBps": 351.5},
}

# tile configs tried per (kv kind, head class) with --sweep-configs; {} = the launcher default.
# The 2026-11-29 sweep (tile sizes, stages, both kernels, fp16 products; results in
# benchmarks/results/h200/kernels_sweep.json) chose today's defaults; this one tries what the
# ncu profiles point at (benchmarks/results/h200/profile/): more warps against register spills.
# Producer/consumer warps for the KV loop (Triton's Hopper autoWS) gained nothing at any decode
# shape (2026-12-01, 16 and 128 heads, bf16 and fp8) and mla_decode no longer takes them.
# 2026-12-01: the few-heads default became the head-group kernel with one-page tiles and 3
# stages (benchmarks/decode_configs.py), so many heads try half-page tiles with deeper pipelines
# (a 64-head q tile takes 72 KB of shared memory, a 64-token stage 72 KB, a 32-token one 36 KB).
SWEEP: dict[tuple[str, str], list[dict[str, Any]]] = {
    ("bf16", "few"): [{}],
    ("bf16", "many"): [{}, {"BLOCK_H": 32, "num_warps": 4},
                       {"BLOCK_N": 32, "num_stages": 3}, {"BLOCK_N": 32, "num_stages": 4}],
    ("fp8", "few"): [{}, {"num_warps": 8}, {"BLOCK_N": 64, "num_warps": 8},
                     {"fp8_fp16": False}],
    ("fp8", "many"): [{}, {"BLOCK_N": 64}, {"fp8_fp16": True}],
}
# split counts timed per config: the full set for the launcher default ({}, which the split
# heuristic is checked against), a few for the other configs (keeps the sweep to minutes)
SPLITS_DEFAULT = (1, 2, 4, 8, 16, 32)
SPLITS = (4, 16)


_VERIFIED: dict[tuple, bool] = {}


def verify_config(dev, kind, heads, cfg) -> bool:
    """``cfg`` against the fp64 reference at L=512, R=64, page 64: lengths that leave partial tail
    tiles, block tables padded with -1 columns, 1 / 3 / auto splits (cached per config)."""
    key = (kind, heads, json.dumps(cfg, sort_keys=True))
    if key in _VERIFIED:
        return _VERIFIED[key]
    gen = torch.Generator(device=dev).manual_seed(7)
    lens = [1, 63, 65, 700, 2500, 4095]
    pages = [triton.cdiv(n, PAGE) for n in lens]
    kv, scale, _ = paged_pool(1, sum(pages) * PAGE, kind, dev, gen)
    # -1 padded columns; the width a multiple of 16 like the benchmark tables, so Triton
    # specialises the row stride alike and the timed runs reuse the compiled kernels
    width = triton.cdiv(max(pages) + 3, 16) * 16
    table = torch.full((len(lens), width), -1, dtype=torch.int32, device=dev)
    perm = torch.randperm(sum(pages), device=dev, generator=gen).to(torch.int32)
    used = 0
    for i, n in enumerate(pages):
        table[i, :n] = perm[used:used + n]
        used += n
    q = torch.randn(len(lens), heads, D, device=dev, dtype=torch.bfloat16, generator=gen)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=dev)
    ok = True
    for splits in (1, 3, None):
        # the q the kernels read (e4m3 for the many-head Hopper kernel with fp8 KV)
        q_read = query_as_read(q, kv, L, splits, cfg or None)
        ref_out, ref_lse = K.mla_decode_ref(q_read, kv, table, lens_t, SM_SCALE, L,
                                            kv_scale=scale)
        try:
            out, lse = K.mla_decode(q, kv, table, lens_t, SM_SCALE, L, kv_scale=scale,
                                    num_splits=splits, config=cfg or None)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - a config that does not compile
            print("verify: config failed", kind, heads, cfg, repr(exc)[:200], flush=True)
            ok = False
            break
        good = bool(torch.isfinite(out.float()).all()) and torch.allclose(
            out.float(), ref_out.float(), atol=2e-2, rtol=2e-2
        ) and torch.allclose(lse[lens_t > 0], ref_lse[lens_t > 0], atol=2e-3, rtol=2e-3)
        if not good:
            err = (out.float() - ref_out.float()).abs().max().item()
            print("verify: WRONG", kind, heads, cfg, splits, "max err", err, flush=True)
            ok = False
    _VERIFIED[key] = ok
    return ok


def precheck(result: dict, max_procs: int = 12) -> None:
    """Verify every swept config (and the defaults) in parallel subprocesses first (at most
    ``max_procs`` at a time); configs that fault or differ from the reference are dropped from
    the sweep and listed in ``result``."""
    args = [json.dumps([kind, 128 if cls == "many" else 16, cfg])
            for (kind, cls), cfgs in SWEEP.items() for cfg in cfgs]
    running: dict[str, subprocess.Popen] = {}
    failed = []

    def reap(arg: str) -> None:
        kind, heads, cfg = json.loads(arg)
        ok = running.pop(arg).wait() == 0
        _VERIFIED[(kind, heads, json.dumps(cfg, sort_keys=True))] = ok
        if not ok:
            failed.append([kind, heads, cfg])

    for arg in dict.fromkeys(args):  # unique, in order
        if len(running) >= max_procs:
            reap(next(iter(running)))
        running[arg] = subprocess.Popen(
            [sys.executable, __file__, "--out", "-", "--verify-one", arg])
    while running:
        reap(next(iter(running)))
    for key in SWEEP:
        heads = 128 if key[1] == "many" else 16
        SWEEP[key] = [c for c in SWEEP[key]
                      if _VERIFIED[(key[0], heads, json.dumps(c, sort_keys=True))] or c == {}]
    result["precheck_failed"] = failed
    print("precheck failed:", json.dumps(failed), flush=True)


def _decode_shape(dev, gen, kind, heads, batch, context, sweep, tried) -> tuple[list, int]:
    """(label, timings, config, splits, ok) for the launcher's defaults and the best of the sweep
    (among configs that match the reference; by the CUDA-graph time)."""
    kv, scale, table = paged_pool(batch, context, kind, dev, gen)
    q = torch.randn(batch, heads, D, device=dev, dtype=torch.bfloat16, generator=gen)
    lens = torch.full((batch,), context, dtype=torch.int32, device=dev)

    def run(cfg=None, splits=None):
        return K.mla_decode(q, kv, table, lens, SM_SCALE, L, kv_scale=scale,
                            num_splits=splits, config=cfg or None)

    auto_ok = verify_config(dev, kind, heads, {})
    nan = {"ms": float("nan"), "ms_eager": float("nan")}
    auto = bench_both(run) if auto_ok else nan
    if auto_ok:  # as a forward runs it: the layers share one split plan
        auto["ms_layer"] = layer_ms(run)
    best = (auto, "default", None) if auto_ok else ({"ms": float("inf")}, None, None)
    if sweep:
        for cfg in SWEEP[(kind, "many" if heads > 32 else "few")]:
            ok = verify_config(dev, kind, heads, cfg)
            if not ok:
                continue
            for splits in (None, *(SPLITS_DEFAULT if cfg == {} else SPLITS)):
                entry = {"kernel": "mla_decode", "dtype": kind, "heads": heads, "batch": batch,
                         "context": context, "config": cfg, "num_splits": splits,
                         "verified_correct": ok}
                try:
                    entry.update(bench_both(functools.partial(run, cfg, splits)))
                except Exception as exc:  # a config that does not compile is reported
                    entry["error"] = repr(exc)[:300]
                    tried.append(entry)
                    break
                tried.append(entry)
                print("sweep", kind, heads, batch, context, json.dumps(cfg), splits,
                      round(entry["ms"], 4), round(entry["ms_eager"], 4), flush=True)
                if ok and entry["ms"] < best[0]["ms"]:
                    best = ({k: entry[k] for k in ("ms", "ms_eager")}, cfg, splits)
    row_bytes = D * kv.element_size() + (4 if scale is not None else 0)
    results = [("auto", auto, "default", None, auto_ok)]
    if best[1] is not None:
        results.append(("best", best[0], best[1], best[2], True))
    return results, row_bytes


def decode_records(dev, ceil, sweep: bool, records: list, tried: list, save,
                   shapes=DECODE_SHAPES, kinds=("bf16", "fp8")) -> None:
    gen = torch.Generator(device=dev).manual_seed(0)
    bf16_tokens_per_s: dict[tuple, float] = {}
    for kind in kinds:
        for heads, batch, context in shapes:
            results, row_bytes = _decode_shape(dev, gen, kind, heads, batch, context, sweep, tried)
            torch.cuda.empty_cache()
            kv_bytes = batch * context * row_bytes
            flops = 2 * heads * (D + L) * batch * context
            peer = PEER[(heads, batch, context)]
            for label, times, cfg, splits, ok in results:
                ms = times["ms"]
                rec = {
                    "kernel": "mla_decode", "variant": label, "heads": heads, "batch": batch,
                    "context": context, "dtype": kind, "ms": round(ms, 4),
                    "ms_eager": round(times["ms_eager"], 4),
                    "effective_GBps": round(kv_bytes / ms / 1e6, 1),
                    "TFLOPs": round(flops / ms / 1e9, 1),
                    "tokens_per_s": batch * context / ms * 1e3,
                    "ceiling_copy_GBps": round(ceil["copy_GBps"], 1),
                    "ceiling_matmul_TFLOPs": round(ceil["matmul_TFLOPs"], 1),
                    "pct_copy": round(100 * kv_bytes / ms / 1e6 / ceil["copy_GBps"], 1),
                    "pct_matmul": round(100 * flops / ms / 1e9 / ceil["matmul_TFLOPs"], 1),
                    "peer_ms": peer["ms"], "peer_GBps": peer["GBps"],
                    "peer_TFLOPs": round(flops / peer["ms"] / 1e9, 1),
                    "speedup_vs_peer": round(peer["ms"] / ms, 2),
                    "config": cfg, "num_splits": splits, "verified_correct": ok,
                }
                if "ms_layer" in times:
                    rec["ms_layer"] = round(times["ms_layer"], 4)
                    rec["pct_copy_layer"] = round(
                        100 * kv_bytes / times["ms_layer"] / 1e6 / ceil["copy_GBps"], 1)
                    rec["TFLOPs_layer"] = round(flops / times["ms_layer"] / 1e9, 1)
                if "graph_error" in times:
                    rec["graph_error"] = times["graph_error"]
                if kind == "bf16":
                    bf16_tokens_per_s[(heads, batch, context, label)] = rec["tokens_per_s"]
                else:
                    base = bf16_tokens_per_s.get((heads, batch, context, label))
                    rec["fp8_vs_bf16_tokens"] = round(rec["tokens_per_s"] / base, 2) if base else None
                records.append(rec)
                print(json.dumps(rec), flush=True)
            save()  # after every shape, so a cut-off run keeps what it measured


def merge_decode(path: str, records: list[dict], ceil: dict[str, float]) -> None:
    """Replace the ``mla_decode`` records of ``path`` with ``records`` where heads, batch,
    context and dtype match (others kept, new ones placed before the DSA records); each new
    record and the file's ``decode_<H>_heads_*`` keys carry this run's date and ceilings."""
    with open(path) as f:
        result = json.load(f)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    ceil = {k: round(v, 1) for k, v in ceil.items()}

    def key(r: dict) -> tuple:
        return r["heads"], r["batch"], r["context"], r["dtype"]

    new = {key(r) for r in records}
    kept = [r for r in result["records"] if r["kernel"] != "mla_decode" or key(r) not in new]
    at = next((i for i, r in enumerate(kept) if r["kernel"].startswith("dsa_")), len(kept))
    stamped = [{**r, "measured": now, "ceilings_same_run": ceil} for r in records]
    result["records"] = kept[:at] + stamped + kept[at:]
    for heads in sorted({r["heads"] for r in records}):
        result[f"decode_{heads}_heads_date"] = now
        result[f"decode_{heads}_heads_ceilings"] = ceil
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"merged {len(records)} decode records into {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--no-sweep", action="store_true", help="launcher defaults only")
    parser.add_argument("--sweep-configs", action="store_true",
                        help="also try the tile configs in SWEEP (default: split counts only)")
    parser.add_argument("--only-decode", action="store_true",
                        help="mla_decode only (skip mla_extend and the copies)")
    parser.add_argument("--merge", action="store_true",
                        help="with --only-decode: merge the records into an existing --out file")
    parser.add_argument("--shapes", default="",
                        help="decode shapes HxNxT, comma-separated (default: all six)")
    parser.add_argument("--kinds", default="bf16,fp8", help="KV kinds: bf16, fp8 (comma-separated)")
    parser.add_argument("--only-dsa", action="store_true",
                        help="DSA records only, merged into an existing --out file")
    parser.add_argument("--verify-one", help=argparse.SUPPRESS)  # internal: kind,heads,config
    args = parser.parse_args()
    shapes = DECODE_SHAPES
    if args.shapes:
        shapes = [tuple(int(x) for x in item.split("x")) for item in args.shapes.split(",")]
        unknown = [s for s in shapes if s not in PEER]
        if unknown:
            sys.exit(f"--shapes: {unknown} not among {DECODE_SHAPES}")
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if not kinds or any(k not in ("bf16", "fp8") for k in kinds):
        sys.exit(f"--kinds: {args.kinds!r}; expected bf16 and/or fp8")
    if args.merge and not args.only_decode:
        sys.exit("--merge goes with --only-decode (--only-dsa always merges)")
    if args.merge and not os.path.exists(args.out):
        sys.exit(f"--merge: {args.out} does not exist")
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernel_bench.py needs a GPU")
    if args.verify_one:  # one config in its own process: a faulting kernel cannot stop the run
        kind, heads, cfg = json.loads(args.verify_one)
        sys.exit(0 if verify_config(torch.device("cuda"), kind, heads, cfg) else 1)
    K.set_value_checks(False)  # no host syncs inside the timed loops
    dev = torch.device("cuda")
    if args.only_dsa:
        merge_dsa(args.out, dev)
        return
    props = torch.cuda.get_device_properties(dev)
    ceil = ceilings(dev)
    print(json.dumps(ceil), flush=True)
    result: dict[str, Any] = {
        "machine": {"gpu": props.name, "sms": props.multi_processor_count,
                    "memory_GiB": round(props.total_memory / 2**30, 1), "host": platform.node()},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "triton": triton.__version__, "cuda": torch.version.cuda},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "ceilings": {k: round(v, 1) for k, v in ceil.items()},
        "notes": "decode FLOPs = 2*H*(D+L) per KV token per query; effective_GBps = KV bytes read "
                 "once (rows + fp8 scales) / time; peer = SGLang/vLLM Triton MLA decode, best split "
                 "(measured on an H200 with the same image, kernel_bench.py's PEER); "
                 "copies: (read + write) bytes / time; "
                 "'auto' = launcher defaults, 'best' = best of the decode sweep; decode/extend "
                 "ms = CUDA-graph replay median (do_bench_cudagraph, what graph decode steps pay), "
                 "ms_eager = eager do_bench median (includes the Python launcher); rates use ms; "
                 f"ms_layer = a layer's share of one graph of {LAYERS} decode layers under one "
                 "split plan (what a forward pays: the plan launches once), pct_copy_layer and "
                 "TFLOPs_layer from it; "
                 "copies are eager",
        "records": [],
        "decode_sweep": [],
    }

    def save() -> None:  # after every section, so a cut-off run still leaves its results
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    if not args.sweep_configs:  # split counts of the launcher's own config only
        for key in SWEEP:
            SWEEP[key] = [{}]
    needed = {(k, "many" if h > 32 else "few") for k in kinds for h, _, _ in shapes}
    for key in list(SWEEP):
        if key not in needed:
            del SWEEP[key]
    result["shapes"] = [list(s) for s in shapes]
    result["kinds"] = list(kinds)
    precheck(result)
    if args.merge:
        records: list[dict] = []
        decode_records(dev, ceil, not args.no_sweep, records, result["decode_sweep"],
                       lambda: None, shapes, kinds)
        merge_decode(args.out, records, ceil)
        return
    decode_records(dev, ceil, not args.no_sweep, result["records"], result["decode_sweep"], save,
                   shapes, kinds)
    save()
    if args.only_decode:
        print("wrote", args.out)
        return
    result["records"] += extend_records(dev, ceil)
    save()
    result["records"] += copy_records(dev, ceil)
    save()
    result["records"] += dsa_records(dev, ceil)
    save()
    print("wrote", args.out)


if __name__ == "__main__":
    main()
