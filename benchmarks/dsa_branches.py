"""A DSA decode layer's batch as two halves on two graph branches, against the whole batch on
one stream: the top-k of one half (latency-bound, a few programs a row) can then run beside
the other half's indexer (bandwidth-bound). A study for whether a layer should fork its
selection: batch 16 (halves of 8), index_topk 2,048, 16 and 128 heads, 32K and 128K, bf16 KV;
CUDA-graph replays timed with events.

    python3 benchmarks/dsa_branches.py --out benchmarks/results/h200/dsa_branches.json
"""

from __future__ import annotations

import argparse
import sys

import torch
from _results import save_json  # noqa: E402  (benchmarks/ is on sys.path)
from _timing import captured
from dsa_kernels import decode_layer

import splash.kernels_triton as K


def _layer(ly):
    return ly.sparse(ly.topk(ly.scores()))


def shape_row(dev: torch.device, side: torch.cuda.Stream, heads: int, context: int) -> dict:
    gen = torch.Generator(device=dev).manual_seed(0)
    whole = decode_layer(dev, gen, "bf16", heads, 16, context)
    halves = [decode_layer(dev, gen, "bf16", heads, 8, context) for _ in range(2)]

    def branches():
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        _layer(halves[0])
        with torch.cuda.stream(side):
            _layer(halves[1])
        main.wait_stream(side)

    runs = {"whole_ms": lambda: _layer(whole),
            "halves_serial_ms": lambda: [_layer(h) for h in halves],
            "halves_branches_ms": branches}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(2):  # interleaved, the best of each kept
        for key, fn in runs.items():
            times[key].append(captured(fn)[1])
    return {"heads": heads, "batch": 16, "context": context,
            **{k: round(min(v), 4) for k, v in times.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/dsa_branches.py needs a GPU")
    K.set_value_checks(False)
    dev = torch.device("cuda")
    side = torch.cuda.Stream()
    rows = []
    for heads in (16, 128):
        for context in (32768, 131072):
            rows.append(shape_row(dev, side, heads, context))
            print(rows[-1], flush=True)
            torch.cuda.empty_cache()
    save_json(args.out, {"benchmark": "dsa_branches", "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
