"""The split-KV decode merge alone (``_merge_into``, CUDA-graph timed, microseconds) with the
partials laid out as the balanced plan writes them, for the tree's ``lse_merge`` and earlier
or variant versions of it read from files: where a layer's merge time is the merge's own.

Splits per request: one 128K request among 63 of 1K (the plan at 16 heads gives the long one
137, the others 2), 64 x 4K (4 each), 8 x 4K (16), 128 x 1K (2); 16-bit partials for requests
of at most 8, fp32 past that, as ``mla_decode`` writes them.

    python3 benchmarks/lse_merge_alone.py --heads 16 --variants old=/tmp/old_lse_merge.py \
        --out merge_alone.json
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import sys

import torch
from _results import save_json  # noqa: E402  (benchmarks/ is on sys.path)
from triton.testing import do_bench_cudagraph

from splash.kernels_triton import lse_merge

LAYOUTS = [("1x128K + 63x1K", [137] + [2] * 63), ("64x4K", [4] * 64), ("8x4K", [16] * 8),
           ("128x1K", [2] * 128)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--variants", default="", help="name=path.py,... beside the tree's")
    ap.add_argument("--programs", type=int, default=264,
                    help="the plan's programs (a head group's): the bound it passes the merge")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/lse_merge_alone.py needs a GPU")
    dev = torch.device("cuda")
    mods = {"tree": lse_merge}
    for item in filter(None, args.variants.split(",")):
        name, path = item.split("=")
        spec = importlib.util.spec_from_file_location(f"splash.kernels_triton.ab_{name}", path)
        mods[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mods[name])
    H, L = args.heads, 512
    rows = []
    for shape, splits in LAYOUTS:
        N, total = len(splits), sum(splits)
        ranges = torch.tensor([0] + torch.tensor(splits).cumsum(0).tolist(), dtype=torch.int32,
                              device=dev)
        o = torch.randn(total, 1, H, L, device=dev)
        o_low, lse = o.to(torch.bfloat16), torch.randn(total, 1, H, device=dev)
        out = torch.empty(N, H, L, device=dev, dtype=torch.bfloat16)
        lse_out = torch.empty(N, H, device=dev)
        row = {"shape": shape, "heads": H, "splits_max": max(splits)}
        for name, mod in mods.items():
            # the tree's merge takes the plan's bound on a request's partials
            kw = {"max_rows": args.programs - N + 1} if name == "tree" else {}
            merge = functools.partial(mod._merge_into, o, lse, out, lse_out, ranges=ranges,
                                      low=(o_low, 8), **kw)
            merge()
            row[f"us_{name}"] = round(float(do_bench_cudagraph(merge, rep=50)) * 1e3, 2)
        rows.append(row)
        print(row, flush=True)
    save_json(args.out, {"benchmark": "lse_merge_alone", "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
