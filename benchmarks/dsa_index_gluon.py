"""The Gluon decode indexer (``kernels_triton/dsa_index_gluon.py``) against the Triton one, on
DSA decode layers at batch 16: the scores call alone and the layer (scores, top-k, sparse MLA),
CUDA-graph timed, each launch config in turn three times (best kept), with the largest
difference of its scores from the Triton kernel's.

    python3 benchmarks/dsa_index_gluon.py --out benchmarks/results/h200/dsa_index_gluon.json
"""

from __future__ import annotations

import argparse
import sys

import torch
from _results import save_json  # noqa: E402  (benchmarks/ is on sys.path)
from _timing import bench_both, ceilings
from dsa_kernels import decode_layer

import splash.kernels_triton as K

# index_scores configs: the Triton kernel, then Gluon stages x programs an SM (default 4 x 4)
VARIANTS = {"triton": {"gluon": False}, "g4x4": {},
            "g6x3": {"gluon_stages": 6, "gluon_programs_per_sm": 3},
            "g8x2": {"gluon_stages": 8, "gluon_programs_per_sm": 2},
            "g4x2": {"gluon_programs_per_sm": 2},
            "g3x5": {"gluon_stages": 3, "gluon_programs_per_sm": 5},
            "g6x4": {"gluon_stages": 6}}
SHAPES = (("bf16", 16, 32768), ("bf16", 16, 131072), ("bf16", 128, 32768), ("fp8", 16, 32768))


def shape_row(dev, kind: str, heads: int, context: int) -> dict:
    layers = {}
    for name, cfg in VARIANTS.items():
        gen = torch.Generator(device=dev).manual_seed(0)
        layers[name] = decode_layer(dev, gen, kind, heads, 16, context,
                                    configs={"index_scores": cfg})
    ref = layers["triton"].scores()
    seen = torch.isfinite(ref)
    res = {}
    for name, t in layers.items():
        s = t.scores()
        res[name] = {"config": VARIANTS[name],
                     "err_vs_triton": float((s[seen] - ref[seen]).abs().max()
                                            / ref[seen].abs().max()),
                     "same_unseen": bool(torch.equal(torch.isinf(s), torch.isinf(ref))),
                     "scores_ms": [], "layer_ms": []}
    for _ in range(3):
        for name, t in layers.items():
            res[name]["scores_ms"].append(round(bench_both(t.scores)["ms"], 4))
            res[name]["layer_ms"].append(
                round(bench_both(lambda t=t: t.sparse(t.topk(t.scores())))["ms"], 4))
    for r in res.values():
        r["scores_best"], r["layer_best"] = min(r["scores_ms"]), min(r["layer_ms"])
    return {"kind": kind, "heads": heads, "batch": 16, "context": context, "variants": res}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/dsa_index_gluon.py needs a GPU")
    K.set_value_checks(False)
    dev = torch.device("cuda")
    ceil = ceilings(dev)
    rows = []
    for kind, heads, context in SHAPES:
        rows.append(shape_row(dev, kind, heads, context))
        print({n: (v["scores_best"], v["layer_best"]) for n, v in rows[-1]["variants"].items()},
              flush=True)
        torch.cuda.empty_cache()
    save_json(args.out, {"benchmark": "dsa_index_gluon", "ceilings": ceil, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
