"""The dimension-chunked decode kernel (``config["dim_chunks"]``) against the head-group kernel
(``dim_chunks: False``) and the chunked kernel's tiles, warps, stages and page-id gathering
(``gather_pages``), at few and many heads,
bf16 and fp8 KV (graph-timed, page 64, random page order; each output compared with the first
variant's).

    python3 benchmarks/decode_chunks.py --out benchmarks/results/h200/decode_chunks.json
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

SHAPES = [(16, 64, 4096), (16, 64, 32768), (16, 16, 131072), (16, 128, 1024),
          (128, 8, 32768), (128, 64, 4096)]
FEW = [{}, {"dim_chunks": False}, {"dim_chunks": True, "num_stages": 2},
       {"dim_chunks": True, "num_stages": 4}, {"dim_chunks": True, "BLOCK_N": 32},
       {"dim_chunks": True, "BLOCK_N": 32, "num_stages": 4},
       {"dim_chunks": True, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2},
       {"dim_chunks": True, "programs_per_sm": 3}, {"gather_pages": True},
       {"gather_pages": True, "num_stages": 4}, {"gather_pages": True, "num_stages": 2}]
# fp8 KV at few heads (its table entry has 32-token tiles): the chunked kernel on 64-token ones
FP8_FEW = [{}, {"dim_chunks": False}, {"BLOCK_N": 64}, {"BLOCK_N": 64, "num_stages": 2},
           {"BLOCK_N": 64, "num_warps": 8, "num_stages": 2}, {"num_stages": 4},
           {"gather_pages": True}, {"gather_pages": True, "num_stages": 4},
           {"gather_pages": True, "BLOCK_N": 64}, {"gather_pages": True, "BLOCK_N": 64,
                                                   "num_stages": 4}]
# many heads: 2 stages of 64-token tiles fill shared memory, and Triton overlaps no copy with
# compute below 3 stages, so the gathered page ids are tried on 32-token tiles
MANY = [{}, {"dim_chunks": True}, {"dim_chunks": True, "BLOCK_H": 32, "num_warps": 4},
        {"dim_chunks": True, "BLOCK_N": 32}, {"gather_pages": True, "num_stages": 3},
        {"gather_pages": True, "BLOCK_N": 32, "num_stages": 3},
        {"gather_pages": True, "BLOCK_N": 32, "num_stages": 4}]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/h200/decode_chunks.json")
    ap.add_argument("--kinds", default="bf16,fp8", help="KV kinds, comma-separated")
    ap.add_argument("--max-heads", type=int, default=128, help="skip shapes with more heads")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/decode_chunks.py needs a GPU")
    K.set_value_checks(False)
    dev = torch.device("cuda")
    ceil = ceilings(dev)
    rows = []
    for kind in args.kinds.split(","):
        for heads, batch, context in [s for s in SHAPES if s[0] <= args.max_heads]:
            run, nbytes = paged_problem(heads, [context] * batch, dev, fp8=kind == "fp8")
            first = None
            few = FP8_FEW if kind == "fp8" else FEW
            for cfg in few if heads <= 32 else MANY:
                row = {"kv": kind, "heads": heads, "batch": batch, "context": context, "cfg": cfg}
                try:
                    out = run(cfg)[0].float()
                except Exception as e:  # a variant that does not fit (shared memory, registers)
                    rows.append({**row, "error": repr(e)[:200]})
                    continue
                first = out if first is None else first
                ms = float(do_bench_cudagraph(functools.partial(run, cfg), rep=30))
                rows.append({**row, "ms": round(ms, 4), "GBps": round(nbytes / ms / 1e6),
                             "pct_copy": round(100 * nbytes / ms / 1e6 / ceil["copy_GBps"], 1),
                             "max_abs_diff": float((out - first).abs().max())})
                print(rows[-1], flush=True)
            run = None
            torch.cuda.empty_cache()
    save_json(args.out, {"benchmark": "decode_chunks", "rows": rows, "ceilings": ceil})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
