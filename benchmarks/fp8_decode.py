"""fp8 KV decode against a bf16 cache of the same shape: mla_decode's fp8 launch variants
(graph-timed, page 64, random page order), each with its speed relative to the bf16 cache's
default launch (tokens/s ratio) and its largest difference from the first variant's output.

    python3 benchmarks/fp8_decode.py --out benchmarks/results/h200/fp8_decode.json

Variants: the tuned default; ``fp8_ptx: False`` (the tile widened by a plain cast, which the
compiler copies into both products' operand layouts); tile and stage choices; at few heads page
ids loaded per tile (``gather_pages: False``) or gathered in smaller blocks, the unchunked
kernel (``dim_chunks: False``, also for the bf16 cache); for many heads fp16 products
(``fp8_fp16``).
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch
from _results import save_json  # noqa: E402  (benchmarks/ is on sys.path)
from _timing import ceilings
from decode_configs import paged_problem
from triton.testing import do_bench_cudagraph

from splash import kernels_triton as K

SHAPES = [(16, 64, 4096), (16, 64, 32768), (16, 16, 131072), (128, 8, 32768), (128, 64, 4096)]
FEW_HEADS = [{}, {"gather_pages": False, "BLOCK_N": 32}, {"gather_pages": 2}, {"gather_pages": 4},
             {"num_stages": 2}, {"num_stages": 4}, {"fp8_ptx": False}, {"dim_chunks": False}]
# bf16 launches beside the default, at few heads (their ms in "bf16_variants")
BF16_FEW_HEADS = [{"dim_chunks": False}, {"gather_pages": True}]
MANY_HEADS = [{}, {"fp8_fp16": True}, {"fp8_fp16": True, "fp8_ptx": False},
              {"fp8_fp16": True, "BLOCK_N": 64}]


def _ms(run, cfg) -> float:
    return float(do_bench_cudagraph(functools.partial(run, cfg), rep=30))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/h200/fp8_decode.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/fp8_decode.py needs a GPU")
    K.set_value_checks(False)
    dev = torch.device("cuda")
    rows = []
    for heads, batch, context in SHAPES:
        lens = [context] * batch
        bf16_run, bf16_bytes = paged_problem(heads, lens, dev, fp8=False)
        bf16_ms = _ms(bf16_run, None)
        bf16_variants = [{"cfg": c, "ms": round(_ms(bf16_run, c), 4)}
                         for c in (BF16_FEW_HEADS if heads <= 32 else [])]
        bf16_run = None
        run, nbytes = paged_problem(heads, lens, dev, fp8=True)
        first = None
        for cfg in FEW_HEADS if heads <= 32 else MANY_HEADS:
            try:
                out = run(cfg)[0].float()
            except Exception as e:  # a variant that does not fit (shared memory, registers)
                rows.append({"heads": heads, "batch": batch, "context": context, "cfg": cfg,
                             "error": repr(e)[:200]})
                continue
            first = out if first is None else first
            ms = _ms(run, cfg)
            rows.append({"heads": heads, "batch": batch, "context": context, "cfg": cfg,
                         "ms": round(ms, 4), "GBps": round(nbytes / ms / 1e6),
                         "bf16_ms": round(bf16_ms, 4), "vs_bf16": round(bf16_ms / ms, 3),
                         "bf16_variants": bf16_variants,
                         "max_abs_diff": float((out - first).abs().max())})
            print(rows[-1], flush=True)
        run = None
        torch.cuda.empty_cache()
    save_json(args.out, {"benchmark": "fp8_decode", "rows": rows, "ceilings": ceilings(dev)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
