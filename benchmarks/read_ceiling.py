"""Read bandwidth by size next to few-head MLA decode of the same bytes (one H200 run).

    python3 benchmarks/read_ceiling.py --out benchmarks/results/h200/read_ceiling.json

The decode records in kernels.json are compared with the copy bandwidth of a 2 GiB clone. A
decode step reads far less (302 MB at 64 requests x 4K tokens, 16 heads, bf16), and a read of
that size pays a fixed start-up and drain that a 2 GiB copy hides. So, graph-timed in one run:
- ``torch.sum`` over a bf16 buffer (a read-only reduction: the best plain read torch ships) and
  ``clone`` (read + write) at the decode shapes' KV bytes and a few more sizes;
- ``mla_decode`` (16 heads, bf16 KV, the launcher's defaults) at 64 x 1K / 2K / 4K / 8K /
  32K and 16 x 128K, as GB/s of KV read, % of the 2 GiB copy ceiling and % of the sum of the
  same bytes.
"""

from __future__ import annotations

import argparse
import sys

import torch
from _results import save_json  # noqa: E402  (benchmarks/ is on sys.path)
from _timing import ceilings
from decode_configs import problem
from triton.testing import do_bench_cudagraph

from splash import kernels_triton as K

SHAPES = [(64, 1024), (64, 2048), (64, 4096), (64, 8192), (64, 32768), (16, 131072)]
EXTRA_MB = [75, 604, 2416]


def graph_ms(fn) -> float:
    return float(do_bench_cudagraph(fn, rep=30))


def reads(nbytes: int, dev: torch.device) -> dict[str, float]:
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev).normal_()
    s, c = graph_ms(lambda: x.sum()), graph_ms(lambda: x.clone())
    return {"MB": round(nbytes / 2**20, 1), "sum_ms": round(s, 4),
            "sum_GBps": round(x.nbytes / s / 1e6), "clone_ms": round(c, 4),
            "clone_GBps": round(2 * x.nbytes / c / 1e6)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/h200/read_ceiling.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/read_ceiling.py needs a GPU")
    K.set_value_checks(False)
    dev = torch.device("cuda")
    ceil = ceilings(dev)
    rows = []
    for batch, context in SHAPES:
        run, nbytes = problem(16, batch, context, dev)
        ms = graph_ms(run)
        del run
        torch.cuda.empty_cache()
        read = reads(nbytes, dev)
        row = {"heads": 16, "batch": batch, "context": context, "decode_ms": round(ms, 4),
               "decode_GBps": round(nbytes / ms / 1e6),
               "pct_copy": round(100 * nbytes / ms / 1e6 / ceil["copy_GBps"], 1),
               "pct_sum_same_bytes": round(100 * read["sum_ms"] / ms, 1), **read}
        rows.append(row)
        print(row, flush=True)
        torch.cuda.empty_cache()
    extra = [reads(mb << 20, dev) for mb in EXTRA_MB]
    save_json(args.out, {"benchmark": "read_ceiling", "ceilings": ceil, "decode": rows,
                         "reads": extra})
    return 0


if __name__ == "__main__":
    sys.exit(main())
