"""The decode step's small ops: the fused Triton kernels against the torch ops they replace.

RMSNorm (alone and with the residual add), RoPE and MoE routing at V3 / Kimi-K2 dims, for
decode batches of 1 to 256 rows, timed inside CUDA graphs (as a decode step replays them)
and eagerly, beside the same run's copy bandwidth:

    python benchmarks/small_ops.py --out benchmarks/results/h200/small_ops.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from _results import save_json  # noqa: E402  (benchmarks/ is on sys.path)
from _timing import bench_both, ceilings

from splash.kernels_triton import (
    add_rms_norm,
    add_rms_norm_ref,
    moe_route,
    moe_route_ref,
    rms_norm,
    rms_norm_ref,
    rope,
    rope_ref,
)

HIDDEN, Q_LORA, KV_LORA, ROPE, HEADS, EXPERTS = 7168, 1536, 512, 64, 128, 256


def cases(rows: int, dev: torch.device) -> dict[str, tuple]:
    """name -> (triton fn, torch fn, bytes read + written) at ``rows`` decode rows."""
    g = torch.Generator(device=dev).manual_seed(rows)
    bf = torch.bfloat16

    def rand(*shape, dtype=bf):
        return torch.randn(*shape, generator=g, device=dev, dtype=torch.float32).to(dtype)

    h, d, w = rand(rows, HIDDEN), rand(rows, HIDDEN), rand(HIDDEN)
    lat, wl = rand(rows, KV_LORA), rand(KV_LORA)
    q = rand(rows, HEADS, ROPE)
    pos = torch.arange(rows, device=dev) + 1000
    inv = 1.0 / 10000 ** (torch.arange(0, ROPE, 2, device=dev).float() / ROPE)
    logits, bias = rand(rows, EXPERTS, dtype=torch.float32), rand(EXPERTS, dtype=torch.float32)
    route = (bias, "sigmoid", "noaux_tc", 8, 4, 8, True, 2.5)
    b = 2  # bf16 bytes
    return {
        "rms_norm_hidden": (lambda: rms_norm(h, w, 1e-6), lambda: rms_norm_ref(h, w, 1e-6),
                            2 * rows * HIDDEN * b),
        "add_rms_norm_hidden": (lambda: add_rms_norm(h, d, w, 1e-6),
                                lambda: add_rms_norm_ref(h, d, w, 1e-6),
                                4 * rows * HIDDEN * b),
        "rms_norm_kv_latent": (lambda: rms_norm(lat, wl, 1e-6),
                               lambda: rms_norm_ref(lat, wl, 1e-6), 2 * rows * KV_LORA * b),
        "rope_q_128_heads": (lambda: rope(q, pos, inv, 1.0, True),
                             lambda: rope_ref(q, pos, inv, 1.0, True), 2 * q.numel() * b),
        "moe_route_256_experts": (lambda: moe_route(logits, *route),
                                  lambda: moe_route_ref(logits, *route),
                                  rows * EXPERTS * 4),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,64,256")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"),
                                                  "small_ops.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("small_ops needs a CUDA GPU (the kernels' CPU path is torch itself)")
        return 2
    dev = torch.device("cuda")
    ceil = ceilings(dev)
    records = []
    for rows in map(int, args.rows.split(",")):
        for name, (fused, ref, moved) in cases(rows, dev).items():
            t, r = bench_both(fused), bench_both(ref)
            rec = {"op": name, "rows": rows, "triton_us": 1e3 * t["ms"],
                   "torch_us": 1e3 * r["ms"], "speedup": r["ms"] / t["ms"],
                   "triton_us_eager": 1e3 * t["ms_eager"], "torch_us_eager": 1e3 * r["ms_eager"],
                   "pct_copy_bw": 100 * moved / (t["ms"] * 1e-3) / (ceil["copy_GBps"] * 1e9)}
            print(rec, flush=True)
            records.append(rec)
    save_json(args.out, {"benchmark": "small_ops", "timing": "CUDA-graph median (eager beside)",
                         **ceil, "records": records})
    return 0


if __name__ == "__main__":
    sys.exit(main())
