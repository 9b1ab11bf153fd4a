"""A forward's decode layers sharing one balanced-split plan (``plan_scope``, what
``Model.forward`` opens) against a plan launch per layer: ``LAYERS`` mla_decode launches over
the same lengths in one CUDA graph, with and without the scope (interleaved, the best of two
runs each), per-layer ms.

    python3 benchmarks/decode_layers.py --out benchmarks/results/h200/decode_layers.json
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch
from _results import save_json  # noqa: E402  (benchmarks/ is on sys.path)
from decode_balance import BATCHES
from decode_configs import paged_problem
from triton.testing import do_bench_cudagraph

from splash import kernels_triton as K

LAYERS = 8


def layer_ms(run, scoped: bool = True, rep: int = 30) -> float:
    """A layer's share (ms) of one CUDA graph of ``LAYERS`` calls of ``run``, under one
    ``plan_scope`` (as ``Model.forward`` runs them) or, ``scoped=False``, a plan each."""
    def layers() -> None:
        with K.plan_scope() if scoped else contextlib.nullcontext():
            for _ in range(LAYERS):
                run()

    return float(do_bench_cudagraph(layers, rep=rep)) / LAYERS


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/h200/decode_layers.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/decode_layers.py needs a GPU")
    K.set_value_checks(False)
    dev = torch.device("cuda")
    rows = []
    for name, heads, lens, fp8 in BATCHES:
        run, _ = paged_problem(heads, lens, dev, fp8)

        times: dict = {"per_layer_plan": [], "one_plan": []}
        for _ in range(2):
            for tag, scoped in (("per_layer_plan", False), ("one_plan", True)):
                times[tag].append(layer_ms(run, scoped))
        row = {"batch": name, "layers": LAYERS,
               **{tag: round(min(t), 4) for tag, t in times.items()},
               "runs_ms": {tag: [round(x, 4) for x in t] for tag, t in times.items()}}
        rows.append(row)
        print(row, flush=True)
        run = None
        torch.cuda.empty_cache()
    save_json(args.out, {"benchmark": "decode_layers", "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
