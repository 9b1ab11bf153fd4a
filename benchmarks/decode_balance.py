"""mla_decode with balanced splits (``config["balanced"]``) against one split count for every
request (the wave model, ``balanced: False``), on uniform and mixed-length batches (graph-timed,
bf16 / fp8 KV, page 64; the two launches interleaved, the best of two runs each).

    python3 benchmarks/decode_balance.py --out benchmarks/results/h200/decode_balance.json

A mixed batch (one long request among short ones) is where one split count for every request
leaves a few programs streaming the long history while the rest of the GPU idles. Each row
gives ms and GB/s of KV read for both launches and the largest difference of their outputs.
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

BATCHES = [
    ("16h 64x4K", 16, [4096] * 64, False), ("16h 64x32K", 16, [32768] * 64, False),
    ("16h 16x128K", 16, [131072] * 16, False), ("128h 8x32K", 128, [32768] * 8, False),
    ("16h fp8 64x4K", 16, [4096] * 64, True),
    ("16h 1x128K + 63x1K", 16, [131072] + [1024] * 63, False),
    ("16h 4x64K + 60x512", 16, [65536] * 4 + [512] * 60, False),
    ("128h 1x128K + 15x2K", 128, [131072] + [2048] * 15, False),
    # serving-like: lengths spread evenly over 1K-32K (a fixed draw)
    ("16h 64 x 1K-32K", 16, [1024 + (i * 7919) % 31745 for i in range(64)], False),
    ("128h 16 x 1K-32K", 128, [1024 + (i * 7919) % 31745 for i in range(16)], False),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/h200/decode_balance.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/decode_balance.py needs a GPU")
    K.set_value_checks(False)
    dev = torch.device("cuda")
    rows = []
    for name, heads, lens, fp8 in BATCHES:
        run, nbytes = paged_problem(heads, lens, dev, fp8)
        row: dict = {"batch": name}
        # interleaved (A B A B), the best of each kept: the GPU's clock drifts with its load
        times: dict = {"wave": [], "balanced": []}
        for _ in range(2):
            for tag, cfg in (("wave", {"balanced": False}), ("balanced", {"balanced": True})):
                times[tag].append(float(do_bench_cudagraph(functools.partial(run, cfg), rep=30)))
        for tag, runs in times.items():
            row[tag] = {"ms": round(min(runs), 4), "GBps": round(nbytes / min(runs) / 1e6),
                        "runs_ms": [round(t, 4) for t in runs]}
        row["max_abs_diff"] = float((run({"balanced": False})[0].float()
                                     - run({"balanced": True})[0].float())
                                    .abs().max())
        rows.append(row)
        print(row, flush=True)
        run = None
        torch.cuda.empty_cache()
    save_json(args.out, {"benchmark": "decode_balance", "rows": rows, "ceilings": ceilings(dev)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
