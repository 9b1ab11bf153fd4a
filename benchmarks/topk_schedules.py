"""``topk_rows``' schedules on the GPU: passes of chunks against rows split into pieces, per
rows × row length, then the DSA decode records (``dsa_kernels.py``) with the split rows' best
launch config.

The scores are random normal fp32 rows of whole 64-token pages, index_topk 2,048 as DeepSeek-V3.2
and GLM-5 take; every timing's winners are checked against torch.topk's (as sets) first. Times
are CUDA-graph medians. The split schedule is swept over piece size × warps × digit width; the
passes run with the tuning table's config (``SPLIT_ELEMS`` 0). ``split_elems`` in the result is
the largest rows × length where the best split config still beat the passes: the tuning table's
``SPLIT_ELEMS``. Run: ``python benchmarks/topk_schedules.py --out topk.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import triton
from _results import save_json  # noqa: E402  (benchmarks/ is on sys.path)
from _timing import ceilings  # noqa: E402
from dsa_kernels import TOPK, dsa_records
from triton.testing import do_bench_cudagraph

import splash.kernels_triton as K

SHAPES = [(16, 32768), (16, 131072), (64, 32768), (64, 131072), (128, 131072), (512, 32768)]
SMALL = 1 << 23  # rows x length up to which the winner is chosen (scores of 32 MiB)
SPLIT_SPACE = [{"SPLIT_CHUNK": c, "split_warps": w, "SPLIT_BITS": b}
               for c, w, b in itertools.product((2048, 4096, 8192), (4, 8, 16), (8, 4))]


def _time(fn, want: torch.Tensor) -> float | str:
    try:
        if not torch.equal(fn().sort(1).values, want):
            return "wrong result"
        return round(float(do_bench_cudagraph(fn, rep=20, return_mode="median")), 4)
    except Exception as exc:  # noqa: BLE001 - a config that does not build is reported
        torch.cuda.synchronize()
        return repr(exc)[:160]


def _shape(n: int, m: int, dev: torch.device, gen: torch.Generator) -> dict:
    scores = torch.randn(n, m, device=dev, generator=gen)
    want = scores.topk(TOPK, dim=1).indices.to(torch.int32).sort(1).values

    def run(cfg: dict) -> torch.Tensor:
        return K.topk_rows(scores, TOPK, config=cfg)[1]

    passes = _time(lambda: run({"SPLIT_ELEMS": 0}), want)
    split = {json.dumps(c): _time(lambda c=c: run({**c, "SPLIT_ELEMS": n * m}), want)
             for c in SPLIT_SPACE}
    best = min((ms, c) for c, ms in split.items() if isinstance(ms, float))
    return {"rows": n, "length": m, "passes_ms": passes, "split_ms": split,
            "best_split": json.loads(best[1]), "best_split_ms": best[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--no-records", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/topk_schedules.py needs a GPU")
    K.set_value_checks(False)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows, totals = [], {json.dumps(c): 0.0 for c in SPLIT_SPACE}
    for n, m in SHAPES:
        rows.append(_shape(n, m, dev, gen))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "split_ms"}), flush=True)
        if n * m <= SMALL:  # the winner: least time summed over the decode-sized shapes
            for c, ms in rows[-1]["split_ms"].items():
                totals[c] += ms if isinstance(ms, float) else float("inf")
    winner = json.loads(min(totals, key=totals.get))
    beaten = [r["rows"] * r["length"] for r in rows
              if isinstance(r["passes_ms"], float)
              and isinstance(ms := r["split_ms"][json.dumps(winner)], float) and ms < r["passes_ms"]]
    result = {"triton": triton.__version__, "index_topk": TOPK, "shapes": rows,
              "winner": winner, "split_elems": max(beaten, default=0)}
    save_json(args.out, result)
    print("winner", json.dumps(winner), "split_elems", result["split_elems"], flush=True)
    if not args.no_records:
        ceil = ceilings(dev)
        result["ceilings"] = ceil
        result["records"] = dsa_records(dev, ceil, configs={"topk": winner})
        save_json(args.out, result)


if __name__ == "__main__":
    main()
