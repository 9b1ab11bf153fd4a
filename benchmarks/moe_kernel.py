"""MoE kernel benchmark: fused_moe on DeepSeek-V2-Lite's routed experts against the matmul peak.

    python benchmarks/moe_kernel.py --out benchmarks/results/h200/moe_kernel.json

Measures, on the current GPU, in bf16:
- ceiling: 8192^3 torch matmul TFLOP/s (same run);
- ``fused_moe``: 64 experts, hidden 2048, I 1408, top-6, N = 4096 tokens routed by the top-6 of
  random logits (about 384 pairs per expert). FLOPs = N·k·(2·hidden·2I + 2·I·hidden) (useful
  work; the BLOCK_M padding is not counted). A small sweep of tile configs, each checked against
  ``fused_moe_ref`` first; per config the two GEMMs are also timed alone, so the best gate_up and
  best down of one BLOCK_M combine into a "composite" config, measured last;
- the breakdown of the default config: alignment, gate_up GEMM, down GEMM, slot sum;
- the torch loop over experts (``routed_experts_torch``, the CPU path of ``MoE``) for comparison.

Timings are ``triton.testing.do_bench`` medians (L2 flushed between repetitions; eager, as a
prefill step runs it) and, per config, ``do_bench_cudagraph`` (as a decode step's graph replays
it: ``ms_graph``); value checks off. ``--no-sweep`` measures the default config only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from typing import Any

import torch
import triton
from _timing import bench as _bench  # noqa: E402  (benchmarks/ on sys.path)
from _timing import matmul_peak
from triton.testing import do_bench_cudagraph

import splash.kernels_triton as K
from splash.kernels_triton.fused_moe import _gemm_configs, _launch_gemm, slot_sum
from splash.kernels_triton.moe_align import moe_align
from splash.model.mlp import routed_experts_torch

E, HIDDEN, I, TOPK, N = 64, 2048, 1408, 6, 4096
FLOPS = N * TOPK * (2 * HIDDEN * 2 * I + 2 * I * HIDDEN)

_BASE = {"BLOCK_K": 64, "GROUP_M": 8}
SWEEP: list[dict[str, Any]] = [
    {},  # launcher default (= the CUDA backend's TUNING entry)
    {**_BASE, "BLOCK_M": 128, "num_warps": 8, "num_stages": 3,
     "gate_up": {"BLOCK_N": 64}, "down": {"BLOCK_N": 128}},
    {**_BASE, "BLOCK_M": 128, "num_warps": 8, "num_stages": 3,
     "gate_up": {"BLOCK_N": 128}, "down": {"BLOCK_N": 256}},
    {**_BASE, "BLOCK_M": 128, "num_warps": 8, "num_stages": 4, "GROUP_M": 16,
     "gate_up": {"BLOCK_N": 128}, "down": {"BLOCK_N": 128}},
    {**_BASE, "BLOCK_M": 128, "num_warps": 4, "num_stages": 4,
     "gate_up": {"BLOCK_N": 64}, "down": {"BLOCK_N": 128}},
    {**_BASE, "BLOCK_M": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3,
     "gate_up": {"BLOCK_N": 64}, "down": {"BLOCK_N": 128}},
    {**_BASE, "BLOCK_M": 64, "num_warps": 8, "num_stages": 5,
     "gate_up": {"BLOCK_N": 128}, "down": {"BLOCK_N": 256}},
]


def bench(fn, rep: int = 100) -> float:
    return _bench(fn, rep=rep, warmup=20)


def problem(dev: torch.device):
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(N, HIDDEN, device=dev, generator=gen).bfloat16()
    w13 = (torch.randn(E, 2 * I, HIDDEN, device=dev, generator=gen) / HIDDEN**0.5).bfloat16()
    w2 = (torch.randn(E, HIDDEN, I, device=dev, generator=gen) / I**0.5).bfloat16()
    logits = torch.randn(N, E, device=dev, generator=gen)
    top = logits.topk(TOPK, dim=-1)
    return x, w13, w2, top.values.softmax(-1), top.indices


def gemm_times(args, cfg: dict | None) -> dict[str, float]:
    """Each stage of fused_moe alone (ms), with the launcher's own allocation and alignment."""
    x, w13, w2, weights, ids = args
    cfgs = _gemm_configs(cfg, x.device)
    M = N * TOPK
    block_m = cfgs["gate_up"]["BLOCK_M"]
    sorted_ids, block_expert = moe_align(ids, E, block_m)
    flat_w = weights.reshape(-1)
    inter = torch.empty(sorted_ids.shape[0], I, dtype=x.dtype, device=x.device)  # sorted rows
    partial = torch.empty(M, HIDDEN, dtype=x.dtype, device=x.device)
    return {
        "align_ms": bench(lambda: moe_align(ids, E, block_m)),
        "gate_up_ms": bench(lambda: _launch_gemm(
            x, w13, inter, sorted_ids, block_expert, flat_w, M, TOPK, I, HIDDEN, True,
            cfgs["gate_up"])),
        "down_ms": bench(lambda: _launch_gemm(
            inter, w2, partial, sorted_ids, block_expert, flat_w, M, 1, HIDDEN, I, False,
            cfgs["down"])),
        "sum_ms": bench(lambda: slot_sum(partial, TOPK)),
    }


def measure(args, ref: torch.Tensor, cfg: dict, peak: float, peak_graph: float
            ) -> dict[str, Any]:
    cfgs = _gemm_configs(cfg or None, args[0].device)
    keys = ("BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")
    rec: dict[str, Any] = {"config": cfg or "default", "resolved": {
        "BLOCK_M": cfgs["down"]["BLOCK_M"],
        **{g: {k: cfgs[g][k] for k in keys} for g in ("gate_up", "down")}}}
    try:
        out = K.fused_moe(*args, config=cfg or None)
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - a config that does not compile (shared memory)
        rec["error"] = repr(exc)[:300]
        return rec
    err = (out.float() - ref).abs()
    rec["max_abs_err"] = round(err.max().item(), 5)
    rec["rel_err"] = round((err.norm() / ref.norm()).item(), 6)
    if rec["rel_err"] > 1e-2:
        rec["error"] = "wrong result"
        return rec
    ms = bench(lambda: K.fused_moe(*args, config=cfg or None))
    tflops = FLOPS / ms / 1e9
    rec.update(ms=round(ms, 4), TFLOPs=round(tflops, 1), ratio_to_matmul=round(tflops / peak, 3))
    # inside a CUDA graph (how decode steps run it): no launch gaps between the 7 kernels
    g_ms = float(do_bench_cudagraph(lambda: K.fused_moe(*args, config=cfg or None), rep=100,
                                    return_mode="median"))
    rec.update(ms_graph=round(g_ms, 4), ratio_to_matmul_graph=round(FLOPS / g_ms / 1e9 / peak, 3),
               ratio_to_matmul_graph_both=round(FLOPS / g_ms / 1e9 / peak_graph, 3))
    rec.update({k: round(v, 4) for k, v in gemm_times(args, cfg).items()})
    return rec


def composite(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The fastest gate_up and the fastest down measured with one BLOCK_M, as one config."""
    done = [r for r in records if "ms" in r]
    best: tuple[float, dict[str, Any]] | None = None
    for block_m in sorted({r["resolved"]["BLOCK_M"] for r in done}):
        rows = [r for r in done if r["resolved"]["BLOCK_M"] == block_m]
        gu = min(rows, key=lambda r: r["gate_up_ms"])
        dn = min(rows, key=lambda r: r["down_ms"])
        total = gu["gate_up_ms"] + dn["down_ms"]
        if best is None or total < best[0]:
            best = (total, {"BLOCK_M": block_m, "gate_up": gu["resolved"]["gate_up"],
                            "down": dn["resolved"]["down"]})
    return None if best is None else best[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--no-sweep", action="store_true", help="the default config only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/moe_kernel.py needs a GPU")
    K.set_value_checks(False)  # no host syncs inside the timed loops
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    peak = matmul_peak(dev, rep=100)
    peak_graph = matmul_peak(dev, rep=100, graph=True)
    ceil = {"matmul_TFLOPs": round(peak, 1), "matmul_TFLOPs_graph": round(peak_graph, 1)}
    print(json.dumps(ceil), flush=True)
    result: dict[str, Any] = {
        "machine": {"gpu": props.name, "sms": props.multi_processor_count,
                    "host": platform.node()},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "triton": triton.__version__, "cuda": torch.version.cuda},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "shape": {"experts": E, "hidden": HIDDEN, "I": I, "topk": TOPK, "tokens": N,
                  "dtype": "bfloat16"},
        "ceilings": ceil,
        "notes": "FLOPs = N*k*(2*hidden*2I + 2*I*hidden) = %.1f GFLOP (padding not counted); "
                 "ratio_to_matmul = TFLOP/s / 8192^3 bf16 torch matmul TFLOP/s of this run "
                 "(eager, L2 flushed); ratio_to_matmul_graph_both = the graph-timed TFLOP/s "
                 "over the same matmul replayed in a CUDA graph (both sustained, no gaps); "
                 "stage times (align/gate_up/down/sum) are each timed alone" % (FLOPS / 1e9),
        "fused_moe": [],
    }

    def save() -> None:  # after every record, so a cut-off run still leaves its results
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    data = problem(dev)
    ref = K.fused_moe_ref(*data).float()
    loop_ms = bench(lambda: routed_experts_torch(*data), rep=200)
    result["torch_loop"] = {"ms": round(loop_ms, 4), "TFLOPs": round(FLOPS / loop_ms / 1e9, 1),
                            "ratio_to_matmul": round(FLOPS / loop_ms / 1e9 / peak, 3)}
    print(json.dumps({"torch_loop": result["torch_loop"]}), flush=True)
    save()
    for cfg in SWEEP[:1] if args.no_sweep else SWEEP:
        rec = measure(data, ref, cfg, peak, peak_graph)
        result["fused_moe"].append(rec)
        print(json.dumps(rec), flush=True)
        save()
    best_cfg = None if args.no_sweep else composite(result["fused_moe"])
    if best_cfg is not None:
        rec = measure(data, ref, best_cfg, peak, peak_graph)
        rec["composite"] = True
        result["fused_moe"].append(rec)
        print(json.dumps(rec), flush=True)
    done = [r for r in result["fused_moe"] if "ms" in r]
    if done:
        best = min(done, key=lambda r: r["ms"])
        result["summary"] = {
            "default_ms": done[0]["ms"] if done[0]["config"] == "default" else None,
            "best_ms": best["ms"], "best_TFLOPs": best["TFLOPs"],
            "best_ratio_to_matmul": best["ratio_to_matmul"], "best_config": best["config"],
            "speedup_vs_torch_loop": round(loop_ms / best["ms"], 2)}
        print(json.dumps({"summary": result["summary"]}), flush=True)
    save()


if __name__ == "__main__":
    main()
