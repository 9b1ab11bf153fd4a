"""The fused MoE kernel at decode sizes, against the bytes roofline: which tiles read the experts'
weights fastest when a step routes 1-64 tokens.

    python benchmarks/moe_decode.py --out benchmarks/results/h200/moe_decode.json

A decode step's MoE reads every expert its tokens hit (3 · hidden · I weights each) and almost
nothing else, so its ceiling is those bytes / the same run's copy bandwidth. Shapes: DeepSeek-V3's
hidden 7,168 and expert width I = 2,048 (one GPU) or 1,024 (each rank's half under two-way
tensor parallelism), top-8 of 32 experts (the benchmark checkpoint) and of 256 (V3).

Per shape and GEMM, a sweep of tiles (BLOCK_M 16/64 for the alignment, BLOCK_N, BLOCK_K,
warps, stages), each GEMM timed alone inside a CUDA graph (as a decode step replays it); then the
best gate_up and down of one BLOCK_M combined and timed end to end beside the backend's current
table ("table"; ``--table-only`` measures that alone). Results are checked against
``fused_moe_ref`` first.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import platform
import sys
from typing import Any

import torch
from _timing import ceilings  # noqa: E402  (benchmarks/ on sys.path)
from triton.testing import do_bench_cudagraph

import splash.kernels_triton as K
from splash.kernels_triton.fused_moe import _gemm_configs, _launch_gemm, fused_moe_ref
from splash.kernels_triton.moe_align import moe_align

HIDDEN, TOPK = 7168, 8
# (experts, I, tokens)
POINTS = [(32, 1024, 1), (32, 1024, 16), (32, 1024, 64), (32, 2048, 1), (32, 2048, 16),
          (32, 2048, 64), (256, 2048, 1), (256, 2048, 64)]


def graph_ms(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return float(do_bench_cudagraph(fn, rep=20, return_mode="median"))


def problem(E: int, I: int, n: int, dev: torch.device):
    gen = torch.Generator(device=dev).manual_seed(n)
    x = torch.randn(n, HIDDEN, device=dev, generator=gen).bfloat16()
    w13 = (torch.randn(E, 2 * I, HIDDEN, device=dev, generator=gen) / HIDDEN**0.5).bfloat16()
    w2 = (torch.randn(E, HIDDEN, I, device=dev, generator=gen) / I**0.5).bfloat16()
    top = torch.randn(n, E, device=dev, generator=gen).topk(TOPK, dim=-1)
    return x, w13, w2, top.values.softmax(-1), top.indices


def sweep() -> list[dict[str, Any]]:
    out = []
    for bm, bn, bk, warps, stages in itertools.product(
            (16, 64), (32, 64, 128), (128, 256), (4, 8), (3, 4)):
        out.append({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps,
                    "num_stages": stages})
    return out


def gemm_ms(args, cfg: dict[str, Any], gemm: str) -> float:
    x, w13, w2, weights, ids = args
    n, E, I = x.shape[0], w13.shape[0], w2.shape[2]
    one = {**cfg, "GROUP_M": 1}
    sorted_ids, block_expert = moe_align(ids, E, one["BLOCK_M"])
    flat_w = weights.reshape(-1)
    M = n * TOPK
    inter = torch.randn(sorted_ids.shape[0], I, dtype=x.dtype, device=x.device)  # sorted rows
    partial = torch.empty(M, HIDDEN, dtype=x.dtype, device=x.device)
    if gemm == "gate_up":
        return graph_ms(lambda: _launch_gemm(x, w13, inter, sorted_ids, block_expert, flat_w, M,
                                             TOPK, I, HIDDEN, True, one))
    return graph_ms(lambda: _launch_gemm(inter, w2, partial, sorted_ids, block_expert, flat_w, M,
                                         1, HIDDEN, I, False, one))


def as_config(best: dict[str, dict[str, Any]]) -> dict[str, Any]:
    g, d = best["gate_up"], best["down"]
    return {"BLOCK_M": g["BLOCK_M"], "GROUP_M": 1,
            "gate_up": {k: g[k] for k in ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")},
            "down": {k: d[k] for k in ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")}}


def measure_shape(E: int, I: int, n: int, copy_gbps: float, dev, sweep_tiles: bool = True
                  ) -> dict[str, Any]:
    args = problem(E, I, n, dev)
    hit = int(torch.unique(args[4]).numel())
    nbytes = hit * 3 * HIDDEN * I * 2
    roof_ms = nbytes / copy_gbps / 1e6
    ref = fused_moe_ref(*args).float()
    rec: dict[str, Any] = {"experts": E, "I": I, "tokens": n, "experts_hit": hit,
                           "bytes": nbytes, "roofline_ms": roof_ms}
    per_bm: dict[int, dict[str, dict[str, Any]]] = {}
    for cfg in sweep() if sweep_tiles else ():
        for gemm in ("gate_up", "down"):
            try:
                ms = gemm_ms(args, cfg, gemm)
            except Exception:  # noqa: BLE001 - a tile that does not fit shared memory
                torch.cuda.synchronize()
                continue
            cur = per_bm.setdefault(cfg["BLOCK_M"], {}).get(gemm)
            if cur is None or ms < cur["ms"]:
                per_bm[cfg["BLOCK_M"]][gemm] = {**cfg, "ms": ms}
    candidates: list[tuple[str, dict | None]] = [("table", None)]
    candidates += [(f"best BLOCK_M {bm}", as_config(b)) for bm, b in sorted(per_bm.items())
                   if len(b) == 2]
    rec["runs"] = []
    for name, cfg in candidates:
        out = K.fused_moe(*args, config=cfg)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        ms = graph_ms(lambda cfg=cfg: K.fused_moe(*args, config=cfg))
        resolved = _gemm_configs(cfg, dev)
        rec["runs"].append({"name": name, "config": resolved, "ms": ms, "rel_err": err,
                            "pct_roofline": 100 * roof_ms / ms,
                            "gemm_ms": {g: b["ms"] for g, b in per_bm.get(
                                resolved["gate_up"]["BLOCK_M"], {}).items()}
                            if name != "table" else None})
        print(json.dumps({k: rec[k] for k in ("experts", "I", "tokens")} | {
            "name": name, "ms": round(ms, 4), "pct_roofline": round(100 * roof_ms / ms, 1),
            "rel_err": round(err, 5)}), flush=True)
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--table-only", action="store_true",
                    help="the backend's current table only (no tile sweep)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    ceil = ceilings(dev)
    copy = ceil["copy_GBps"]
    records = []
    for E, I, n in POINTS:  # saved after every point: a cut run keeps what it measured
        records.append(measure_shape(E, I, n, copy, dev, not args.table_only))
        with open(args.out, "w") as f:
            json.dump({"benchmark": "moe_decode", "partial": True, **ceil, "records": records},
                      f, indent=1)
    result = {"benchmark": "moe_decode", "date": datetime.date.today().isoformat(),
              "machine": platform.node(), "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name(0), "hidden": HIDDEN, "topk": TOPK,
              **ceil, "records": records}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
