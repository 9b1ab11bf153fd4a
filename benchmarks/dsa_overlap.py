"""A DSA decode layer with its rows in groups whose selection overlaps the next group's scores:
the indexer's scores of group g+1 run on the layer's stream while group g's top-k and sparse
MLA run on a stream of their own (forked after g's scores, joined at the end), all in one CUDA
graph. The top-k passes and sparse MLA at batch 16 are chains of short launches that leave
most SMs idle (``dsa_timeline_fit.json``); the indexer streams the whole history. Overlapping
them hides the selection under the streaming, except the last group's.

Per shape (batch 16, index_topk 2048, V3.2 dims, ``dsa_kernels.py``'s pools) and group count:
the graph-timed layer (ms), its share of the bytes roofline (indexer keys + selected rows over
the same run's copy bandwidth, as ``dsa_kernels.py`` counts it) and the largest difference of
its outputs from the one-group layer's.

    python benchmarks/dsa_overlap.py --out dsa_overlap.json [--groups 1,2,4,8]
"""

from __future__ import annotations

import argparse
import sys

import torch
from _paged import PAGE, SM_SCALE, D, L  # noqa: E402  (benchmarks/ is on sys.path)
from _results import save_json
from _timing import bench_both, ceilings
from dsa_kernels import INDEX_DIM, SHAPES, TOPK, decode_layer
from dsa_timeline import timeline

import splash.kernels_triton as K


def grouped_layer(dev, gen, kind: str, heads: int, batch: int, context: int, groups: int):
    """``run() -> [(out, lse) of each group]``: one DSA decode layer over ``batch`` rows in
    ``groups`` contiguous row groups, each group's selection on its own forked stream."""
    t = decode_layer(dev, gen, kind, heads, batch, context)
    kv, scale, keys, key_scale, table, gmax = t.kv, t.scale, t.keys, t.key_scale, t.table, t.gmax
    iq, w, q, lens, width, group = t.iq, t.w, t.q, t.lens, t.width, t.group
    size = -(-batch // groups)
    bounds = [(a, min(a + size, batch)) for a in range(0, batch, size)]
    starts = {n: torch.arange(n + 1, dtype=torch.int32, device=dev) for n in {b - a for a, b in
                                                                               bounds}}
    streams = [torch.cuda.Stream(dev) for _ in bounds[1:]]

    def rows(a: int, b: int):
        g = gmax[a:b] if gmax is not None else None
        s = K.index_scores(iq[a:b], w[a:b], keys, table[a:b], lens[a:b], starts[b - a],
                           INDEX_DIM ** -0.5, width, index_scale=key_scale, max_rows=1,
                           group_max=g, group=group)
        return s, g

    def select(s, g, a: int, b: int):
        slots = K.topk_rows(s, TOPK, block_table=table[a:b], page_size=PAGE, floor_max=g)[1]
        return K.mla_sparse(q[a:b], kv, slots, SM_SCALE, L, kv_scale=scale)

    def run():
        cur = torch.cuda.current_stream(dev)
        outs = []
        for i, (a, b) in enumerate(bounds):
            s, g = rows(a, b)
            if i == len(bounds) - 1:  # the last group's selection stays on the layer's stream
                outs.append(select(s, g, a, b))
                continue
            side = streams[i]
            side.wait_stream(cur)
            s.record_stream(side)  # freed here, read there: not reused before side is done
            with torch.cuda.stream(side):
                outs.append(select(s, g, a, b))
        for side in streams:
            cur.wait_stream(side)
        return outs

    key_bytes = batch * context * (INDEX_DIM + 4)
    sel_bytes = batch * TOPK * (D * kv.element_size() + (4 if scale is not None else 0))
    return run, key_bytes + sel_bytes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--groups", default="1,2,4,8")
    ap.add_argument("--kinds", default="bf16,fp8")
    ap.add_argument("--timeline", type=int, default=4,
                    help="also each shape's per-kernel timeline at this group count (0: none)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/dsa_overlap.py needs a GPU")
    K.set_value_checks(False)
    dev = torch.device("cuda")
    ceil = ceilings(dev)
    counts = [int(g) for g in args.groups.split(",")]
    rows, timelines = [], {}
    for kind in args.kinds.split(","):
        for heads, batch, context in SHAPES:
            base = None
            for groups in counts:
                gen = torch.Generator(device=dev).manual_seed(0)  # the same inputs each count
                run, nbytes = grouped_layer(dev, gen, kind, heads, batch, context, groups)
                got = torch.cat([o for o, _ in run()]).float()
                base = got if base is None else base
                times = bench_both(run)
                ms = times["ms"]
                row = {"kind": kind, "heads": heads, "batch": batch, "context": context,
                       "groups": groups, "ms": round(ms, 4),
                       "ms_eager": round(times["ms_eager"], 4),
                       "pct_copy": round(100 * nbytes / ms / 1e6 / ceil["copy_GBps"], 1),
                       "max_diff_vs_one_group": float((got - base).abs().max())}
                if "graph_error" in times:
                    row["graph_error"] = times["graph_error"]
                rows.append(row)
                print(row, flush=True)
                if groups == args.timeline:
                    timelines[f"{heads}h-{kind}-{context}-g{groups}"] = timeline(run)
                run = None
                torch.cuda.empty_cache()
    save_json(args.out, {"benchmark": "dsa_overlap", "ceilings": ceil, "rows": rows,
                         "timelines": timelines})
    return 0


if __name__ == "__main__":
    sys.exit(main())
