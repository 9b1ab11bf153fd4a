"""mla_decode with many heads (64 per rank: DeepSeek-V3's 128 under two-way TP) at decode batch
sizes: time per split count, graph-timed, bf16, beside the split the launcher picks. It sets
the many-heads ``min_split_tokens`` of the CUDA tuning table.

    python benchmarks/decode_splits.py --out benchmarks/results/h200/decode_splits.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys

import torch
import triton
from triton.testing import do_bench_cudagraph

import splash.kernels_triton as K
from splash.kernels_triton.mla_decode import choose_num_splits, decode_config

H, L, R, PS = 64, 512, 64, 64
POINTS = [(1, 1024), (4, 1024), (16, 1024), (64, 1024), (1, 8192), (16, 8192)]
SPLITS = (1, 2, 4, 8, 16, 32, 64)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for batch, ctx in POINTS:
        g = torch.Generator(device=dev).manual_seed(0)
        width = ctx // PS
        pages = batch * width + 1
        kv = torch.randn(pages, PS, L + R, device=dev, generator=g).bfloat16()
        q = torch.randn(batch, H, L + R, device=dev, generator=g).bfloat16()
        table = torch.randperm(pages - 1, device=dev, generator=g)[: batch * width]
        table = table.view(batch, width).int()
        lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
        cfg = decode_config(H, dev, None)
        picked = choose_num_splits(batch, triton.cdiv(H, cfg["BLOCK_H"]), width * PS, dev, cfg)
        row = {"heads": H, "batch": batch, "context": ctx, "picked_splits": picked, "us": {}}
        for s in SPLITS:
            def fn(s=s, q=q, kv=kv, table=table, lens=lens):
                return K.mla_decode(q, kv, table, lens, 0.1, L, num_splits=s)
            fn()
            torch.cuda.synchronize()
            row["us"][s] = round(float(do_bench_cudagraph(fn, rep=20, return_mode="median"))
                                 * 1e3, 2)
        row["best_splits"] = min(row["us"], key=row["us"].get)
        print(json.dumps(row), flush=True)
        rows.append(row)
    with open(args.out, "w") as f:
        json.dump({"benchmark": "decode_splits", "date": datetime.date.today().isoformat(),
                   "machine": platform.node(), "torch": torch.__version__,
                   "gpu": torch.cuda.get_device_name(0), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
