"""The dense products of a decode step, one by one, against the bytes they must read.

At decode batch sizes every dense projection of an MLA layer is a skinny product bound by its
weight's bytes. This times each distinct one of a DeepSeek-V3-shaped layer as a rank holds it
at T ranks (q_a and kv_a replicated; q_b, the absorbed per-head products, o_proj, the dense
and shared MLPs and the LM head's greedy slice sharded) with torch, CUDA-graph medians, and
reports GB/s and the share of the same run's copy bandwidth: where a product runs well below
the copy rate, a launch-bound or poorly tiled product is worth replacing.

    python benchmarks/dense_gemms.py --tp 1 2 --batches 1 16 64 --out dense_gemms.json
"""

from __future__ import annotations

import argparse
import sys

import torch
from _results import save_json  # noqa: E402  (benchmarks/ is on sys.path)
from _timing import ceilings  # noqa: E402
from triton.testing import do_bench_cudagraph

HIDDEN, Q_LORA, KV, HEADS, NOPE, ROPE, V_DIM, L = 7168, 1536, 576, 128, 128, 64, 128, 512
DENSE_I, MOE_I, EXPERTS, VOCAB = 18432, 2048, 256, 129280


def products(world: int) -> dict[str, tuple]:
    """name -> (kind, shape args) of one rank's products at ``world`` ranks."""
    h = HEADS // world
    return {
        "q_a": ("mm", Q_LORA, HIDDEN), "kv_a": ("mm", KV, HIDDEN),
        "q_b": ("mm", h * (NOPE + ROPE), Q_LORA),
        "w_uk": ("bmm", h, NOPE, L), "w_uv": ("bmm", h, L, V_DIM),
        "o_proj": ("mm", HIDDEN, h * V_DIM),
        "dense_gate_up": ("mm", 2 * DENSE_I // world, HIDDEN),
        "dense_down": ("mm", HIDDEN, DENSE_I // world),
        "shared_gate_up": ("mm", 2 * MOE_I // world, HIDDEN),
        "shared_down": ("mm", HIDDEN, MOE_I // world),
        "router_fp32": ("router", EXPERTS, HIDDEN),
        "lm_head_slice": ("mm", -(-VOCAB // world), HIDDEN),
    }


def _case(kind: str, m: int, dims: tuple, dev: torch.device):
    """(callable, bytes the weights and activations take) of one product at batch ``m``."""
    bf = torch.bfloat16
    if kind == "bmm":
        h, k, n = dims
        a = torch.randn(h, m, k, device=dev, dtype=bf)
        w = torch.randn(h, k, n, device=dev, dtype=bf)
        return (lambda: torch.bmm(a, w)), w.numel() * 2 + a.numel() * 2 + h * m * n * 2
    n, k = dims
    if kind == "router":  # the MoE router: fp32 logits of bf16 rows (the cast included)
        x = torch.randn(m, k, device=dev, dtype=bf)
        w = torch.randn(n, k, device=dev)
        return (lambda: x.float() @ w.t()), w.numel() * 4 + x.numel() * 2 + m * n * 4
    x = torch.randn(m, k, device=dev, dtype=bf)
    w = torch.randn(n, k, device=dev, dtype=bf)
    return (lambda: x @ w.t()), w.numel() * 2 + x.numel() * 2 + m * n * 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/dense_gemms.py needs a GPU")
    dev = torch.device("cuda")
    ceil = ceilings(dev)
    rows = []
    for world in args.tp:
        for name, (kind, *dims) in products(world).items():
            for m in args.batches:
                fn, nbytes = _case(kind, m, tuple(dims), dev)
                ms = float(do_bench_cudagraph(fn, rep=30, return_mode="median"))
                gbps = nbytes / ms / 1e6
                rows.append({"tp": world, "product": name, "batch": m, "ms": round(ms, 5),
                             "bytes": nbytes, "GBps": round(gbps, 1),
                             "pct_copy": round(100 * gbps / ceil["copy_GBps"], 1)})
                print(rows[-1], flush=True)
                torch.cuda.empty_cache()
    save_json(args.out, {"ceilings": ceil, "rows": rows})


if __name__ == "__main__":
    main()
