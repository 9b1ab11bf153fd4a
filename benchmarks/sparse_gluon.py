"""Sparse MLA over the indexer's selection, the Triton kernels against the Gluon decode kernels
that gather the selected rows by cp.async (``config["gluon"]``, Hopper), in the same run.

Batch 16, index_topk 2,048, DeepSeek-V3.2 dims, bf16 and fp8 KV, the DSA layer's own inputs
(``dsa_kernels.decode_layer``: the slots the indexer and top-k pick over a 32K history):
``mla_sparse`` alone at 16 and 128 heads (``--heads``), the Gluon kernels at several split counts, and the
whole layer (scores + top-k + sparse MLA) with each. CUDA-graph medians; ``pct_copy`` is the
selected rows' bytes (or the layer's: keys + rows) over the same run's copy bandwidth;
``max_diff_vs_ref`` is each output's largest difference from the torch reference's.

    python benchmarks/sparse_gluon.py --out benchmarks/results/h200/dsa_sparse_gluon.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from _paged import PAGE, SM_SCALE, D, L  # noqa: E402  (benchmarks/ is on sys.path)
from _results import save_json  # noqa: E402
from _timing import bench_both, ceilings  # noqa: E402
from dsa_kernels import INDEX_DIM, TOPK, decode_layer  # noqa: E402

import splash.kernels_triton as K

# (name, config, num_splits): the Triton kernels, then the Gluon ones at any split length (at
# many heads with fp8 KV asked for fp16 products, which they run: the warp-specialised
# kernel), with 16-bit partial rows, at other split counts
_ANY = {"gluon": True, "gluon_min_split_tiles": 0}
GLUON = {**_ANY, "many_heads": _ANY, "fp8": {"many_heads": {"fp8_fp16": True}}}
FORMS = [("triton", {"gluon": False}, None), ("gluon", GLUON, None),
         ("gluon splits=8", GLUON, 8),
         ("gluon 16-bit partials", {**GLUON, "low_partials": 64}, None),
         ("gluon splits=4", GLUON, 4), ("gluon splits=16", GLUON, 16)]


def _shape_records(dev, ceil, kind: str, heads: int, batch: int, context: int) -> list[dict]:
    """Every form's record at one shape (the layer's inputs drawn once)."""
    gen = torch.Generator(device=dev).manual_seed(0)
    layer = decode_layer(dev, gen, kind, heads, batch, context)
    slots = layer.topk(layer.scores())
    q = torch.randn(batch, heads, D, device=dev, dtype=torch.bfloat16, generator=gen)
    row_bytes = batch * TOPK * (D * layer.kv.element_size() + (4 if layer.scale is not None else 0))
    key_bytes = batch * context * (INDEX_DIM + 4)
    ref = K.mla_sparse_ref(q, layer.kv, slots, SM_SCALE, L, kv_scale=layer.scale)[0]
    records = []
    for name, cfg, splits in FORMS:
        def sparse(s=slots, cfg=cfg, splits=splits):
            return K.mla_sparse(q, layer.kv, s, SM_SCALE, L, kv_scale=layer.scale, config=cfg,
                                num_splits=splits)
        diff = (sparse()[0].float() - ref.float()).abs().max().item()
        times = bench_both(sparse)
        rec = {"kernel": "dsa_sparse_mla", "form": name, "heads": heads, "batch": batch,
               "context": context, "index_topk": TOPK, "kv_dtype": kind, "page": PAGE,
               "ms": round(times["ms"], 4),
               "pct_copy": round(100 * row_bytes / times["ms"] / 1e6 / ceil["copy_GBps"], 1),
               "TFLOPs": round(batch * heads * TOPK * 2 * (D + L) / times["ms"] / 1e9, 1),
               "max_diff_vs_ref": diff}
        if splits is None:  # the launcher's split: the whole layer too
            layer_t = bench_both(lambda cfg=cfg: K.mla_sparse(
                q, layer.kv, layer.topk(layer.scores()), SM_SCALE, L, kv_scale=layer.scale,
                config=cfg))
            rec["layer_ms"] = round(layer_t["ms"], 4)
            rec["layer_pct_copy"] = round(100 * (key_bytes + row_bytes) / layer_t["ms"] / 1e6
                                          / ceil["copy_GBps"], 1)
        records.append(rec)
        print(json.dumps(rec), flush=True)
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--kinds", default="bf16,fp8", help="KV kinds: bf16, fp8")
    parser.add_argument("--heads", default="16,128", help="attention heads (comma-separated)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/sparse_gluon.py needs a GPU")
    K.set_value_checks(False)
    dev = torch.device("cuda")
    ceil = ceilings(dev)
    records = [rec for kind in args.kinds.split(",") for heads in map(int, args.heads.split(","))
               for rec in _shape_records(dev, ceil, kind, heads, 16, args.context)]
    save_json(args.out, {"what": __doc__.splitlines()[0], "ceilings": ceil,
                         "triton": __import__("triton").__version__, "records": records})


if __name__ == "__main__":
    main()
