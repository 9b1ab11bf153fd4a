"""topk_rows' selection variants at DSA decode sizes: 16 rows of 32K-256K scores, k = 2048
(graph-timed), each checked against torch.topk (same sorted values), on two score
distributions (the selection's rounds depend on the values).

    python3 benchmarks/topk_select.py --out benchmarks/results/h200/topk_select.json [--tag T]

Rows: the default launch and the configs a pass may take (warps, chunk); rows of earlier trees
name their own configs (``RADIX_BITS`` 2 / 4 / 8: radix digits, 1: the bisection, before the
radix select was removed). ``--tag`` names the tree measured, so runs of two trees (for
instance before and after a change, in separate processes) can sit in one file side by side.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys

import torch
from _results import save_json  # noqa: E402  (benchmarks/ is on sys.path)
from triton.testing import do_bench_cudagraph

from splash import kernels_triton as K
from splash.kernels_triton import topk as T

CONFIGS = [{}, {"num_warps": 16}, {"CHUNK": 4096}, {"CHUNK": 16384}, {"CHUNK": 16384, "PARTS": 2},
           {"CHUNK": 16384, "PARTS": 4}, {"CHUNK": 16384, "num_warps": 16},
           {"CHUNK": 32768, "num_warps": 16}, {"PARTS": 2}, {"PARTS": 4}, {"SECANT": True},
           {"SECANT": True, "num_warps": 16}, {"SECANT": True, "CHUNK": 16384, "PARTS": 4}]

def _scores(kind: str, width: int, dev: torch.device) -> torch.Tensor:
    """16 rows of ``width`` scores: "relu" relu(N(0, 9)) + U(0, 1) (half the row below 1);
    "indexer" shaped like the lightning indexer's, a positive mix of 64 heads' relu(N(0, 1))."""
    g = torch.Generator(device=dev).manual_seed(0)
    if kind == "relu":
        return torch.randn(16, width, device=dev, generator=g).relu_() * 3 \
            + torch.rand(16, width, device=dev, generator=g)
    w = torch.rand(64, device=dev, generator=g)
    return torch.stack([torch.randn(width, 64, device=dev, generator=g).relu_() @ w
                        for _ in range(16)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/h200/topk_select.json")
    ap.add_argument("--tag", default="this tree")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/topk_select.py needs a GPU")
    K.set_value_checks(False)
    dev = torch.device("cuda")
    rows = []
    for scores, width in itertools.product(("relu", "indexer"), (32768, 65536, 131072, 262144)):
        x = _scores(scores, width, dev)
        ref = T.topk_rows_ref(x, 2048)[0]
        for cfg in CONFIGS:
            try:
                v, _ = T.topk_rows(x, 2048, config=cfg)
            except ValueError as e:  # a config this tree does not have
                rows.append({"tree": args.tag, "M": width, "cfg": cfg, "error": str(e)})
                continue
            exact = bool(torch.equal(v.sort(1, descending=True).values, ref))
            ms = do_bench_cudagraph(functools.partial(T.topk_rows, x, 2048, config=cfg), rep=30)
            rows.append({"tree": args.tag, "scores": scores, "M": width, "cfg": cfg,
                         "ms": round(ms, 4), "exact": exact})
            print(rows[-1], flush=True)
    if os.path.exists(args.out):  # keep other trees' rows
        with open(args.out) as f:
            rows = [r for r in json.load(f).get("rows", []) if r.get("tree") != args.tag] + rows
    save_json(args.out, {"benchmark": "topk_select", "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
