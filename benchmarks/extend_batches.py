"""Absorbed chunked prefill (``mla_extend``) over several requests in one launch, its grid planned
by the rows of the whole batch (``max_rows=None``: the row axis holds as many blocks as all the
rows, most of them empty for any one request) or by the most rows of one request (what the
engine passes). CUDA-graph medians; TFLOP/s counts the causal products of the absorbed form
(QK over L+R, PV over L) beside the same run's bf16 matmul peak.

    python benchmarks/extend_batches.py --out benchmarks/results/h200/extend_batches.json
"""

from __future__ import annotations

import argparse
import sys

import torch
from _results import save_json  # noqa: E402  (benchmarks/ is on sys.path)
from _timing import bench_both, ceilings  # noqa: E402

import splash.kernels_triton as K

L, R, PAGE = 512, 64, 64
# (heads, requests, rows per request, prefix per request)
SHAPES = [(16, 8, 512, 0), (128, 8, 512, 0), (128, 8, 512, 4096), (16, 4, 2048, 0),
          (128, 32, 128, 1024)]


def _flops(heads: int, requests: int, rows: int, prefix: int) -> float:
    keys = requests * sum(prefix + j + 1 for j in range(rows))  # causal: row j sees prefix + j + 1
    return 2.0 * heads * keys * ((L + R) + L)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/extend_batches.py needs a GPU")
    K.set_value_checks(False)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    ceil = ceilings(dev)
    records = []
    for heads, requests, rows, prefix in SHAPES:
        pages = -(-(rows + prefix) // PAGE)
        kv = torch.randn(requests * pages, PAGE, L + R, device=dev, dtype=torch.bfloat16,
                         generator=gen)
        table = torch.randperm(requests * pages, device=dev, generator=gen).to(torch.int32)
        table = table.reshape(requests, pages)
        starts = torch.arange(0, requests * rows + 1, rows, dtype=torch.int32, device=dev)
        lens = torch.full((requests,), rows + prefix, dtype=torch.int32, device=dev)
        q = torch.randn(requests * rows, heads, L + R, device=dev, dtype=torch.bfloat16,
                        generator=gen)

        def run(max_rows, q=q, kv=kv, table=table, lens=lens, starts=starts):
            return K.mla_extend(q, kv, table, lens, starts, (L + R) ** -0.5, L, max_rows=max_rows)

        same = bool(torch.equal(run(None)[0], run(rows)[0]))
        rec = {"heads": heads, "requests": requests, "rows": rows, "prefix": prefix,
               "same_output": same}
        for name, bound in (("by_batch", None), ("by_request", rows)):
            t = bench_both(lambda bound=bound, run=run: run(bound))
            rec[name] = {"ms": round(t["ms"], 4),
                         "TFLOPs": round(_flops(heads, requests, rows, prefix) / t["ms"] / 1e9, 1)}
        rec["speedup"] = round(rec["by_batch"]["ms"] / rec["by_request"]["ms"], 3)
        records.append(rec)
        print(rec, flush=True)
    save_json(args.out, {"benchmark": "extend_batches", "ceilings": ceil, "kv": "bf16",
                         "page": PAGE, "records": records})


if __name__ == "__main__":
    main()
