"""DSA decode kernels on the GPU: the lightning indexer's scores over the paged history, the
top-k of them, and sparse MLA over the winners, at batch 16 (16 and 128 attention heads), 32K
and 128K context, index_topk 2048, DeepSeek-V3.2 dims (64 index heads of 128, fp8 keys with a
per-token scale: 132 B per token; L=512, R=64; page 64, random page order); and the indexer
over a 2,048-row prefill chunk (``dsa_index_prefill``, 32K / 64K history).

Each stage and the whole pipeline (``dsa``: scores + top-k + sparse MLA, what one decode layer
runs) are timed like ``kernel_bench.py``'s decode records (CUDA-graph median ``ms``, eager
``ms_eager``). The bytes roofline counts what the pipeline must read: every history token's
indexer key (+ scale) and the selected latent rows (+ fp8 scales); ``pct_copy`` is that over
the same run's copy bandwidth. Run through ``kernel_bench.py --only-dsa`` (merges the records into
its JSON) or on its own: ``python benchmarks/dsa_kernels.py --out dsa.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from types import SimpleNamespace
from typing import Any

import torch
import triton
from _paged import PAGE, SM_SCALE, D, L  # noqa: E402  (benchmarks/ is on sys.path)
from _timing import bench_both, ceilings  # noqa: E402

import splash.kernels_triton as K
from splash.kernels_triton.topk import floor_group

TOPK = 2048
INDEX_HEADS, INDEX_DIM = 64, 128
SHAPES = [(16, 16, 32768), (16, 16, 131072), (128, 16, 32768), (128, 16, 131072)]


def _pools(batch: int, context: int, kind: str, dev: torch.device, gen: torch.Generator):
    pages_per = triton.cdiv(context, PAGE)
    num_pages = batch * pages_per
    table = torch.randperm(num_pages, device=dev, generator=gen).to(torch.int32)
    table = table.reshape(batch, pages_per)
    keys = torch.empty(num_pages, PAGE, INDEX_DIM, device=dev, dtype=torch.float8_e4m3fn)
    keys.view(torch.uint8).random_(0, 0x7E, generator=gen)  # finite e4m3fn bit patterns
    key_scale = torch.rand(num_pages, PAGE, device=dev, generator=gen) * 0.01 + 0.005
    if kind == "fp8":
        kv = torch.empty(num_pages, PAGE, D, device=dev, dtype=torch.float8_e4m3fn)
        kv.view(torch.uint8).random_(0, 0x7E, generator=gen)
        scale = torch.rand(num_pages, PAGE, device=dev, generator=gen) * 0.01 + 0.005
    else:
        kv = torch.randn(num_pages, PAGE, D, device=dev, dtype=torch.bfloat16, generator=gen)
        scale = None
    return kv, scale, keys, key_scale, table


def _record(name: str, times: dict[str, Any], nbytes: int, ceil: dict[str, float],
            **extra: Any) -> dict[str, Any]:
    ms = times["ms"]
    rec = {"kernel": name, **extra, "ms": round(ms, 4), "ms_eager": round(times["ms_eager"], 4),
           "bytes": nbytes, "effective_GBps": round(nbytes / ms / 1e6, 1),
           "ceiling_copy_GBps": round(ceil["copy_GBps"], 1),
           "pct_copy": round(100 * nbytes / ms / 1e6 / ceil["copy_GBps"], 1)}
    if "graph_error" in times:
        rec["graph_error"] = times["graph_error"]
    return rec


def decode_layer(dev, gen, kind: str, heads: int, batch: int, context: int,
                 configs: dict | None = None):
    """A DSA decode layer's three stages over fresh inputs: ``scores()``, ``topk(scores) ->
    slots``, ``sparse(slots) -> (out, lse)``, with the pool (``kv``, ``scale``, ``table``) and the
    indexer's group maxima (``gmax``, ``group``) taken where the engine takes them
    (``topk_indexed``); ``configs``: kernel -> launch config."""
    kv, scale, keys, key_scale, table = _pools(batch, context, kind, dev, gen)
    iq = torch.randn(batch, INDEX_HEADS, INDEX_DIM, device=dev, dtype=torch.bfloat16,
                     generator=gen)
    w = torch.randn(batch, INDEX_HEADS, device=dev, generator=gen) * INDEX_HEADS ** -0.5
    q = torch.randn(batch, heads, D, device=dev, dtype=torch.bfloat16, generator=gen)
    lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    starts = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    width = table.shape[1] * PAGE
    configs = configs or {}
    group = floor_group(dev, TOPK, width, configs.get("topk"))
    gmax = torch.empty((batch, -(-width // group)), device=dev) if group else None

    def scores():
        return K.index_scores(iq, w, keys, table, lens, starts, INDEX_DIM ** -0.5, width,
                              index_scale=key_scale, config=configs.get("index_scores"),
                              max_rows=1, group_max=gmax, group=group)

    def topk(s):
        return K.topk_rows(s, TOPK, block_table=table, page_size=PAGE,
                           config=configs.get("topk"), floor_max=gmax)[1]

    def sparse(slots):
        return K.mla_sparse(q, kv, slots, SM_SCALE, L, kv_scale=scale,
                            config=configs.get("mla_sparse"))

    return SimpleNamespace(scores=scores, topk=topk, sparse=sparse, kv=kv, scale=scale,
                           table=table, gmax=gmax, group=group, keys=keys, key_scale=key_scale,
                           iq=iq, w=w, q=q, lens=lens, width=width)


def _shape_records(dev, gen, ceil, kind: str, heads: int, batch: int,
                   context: int, configs: dict | None = None) -> list[dict]:
    layer = decode_layer(dev, gen, kind, heads, batch, context, configs)
    scores, topk, sparse, kv, scale, gmax = (layer.scores, layer.topk, layer.sparse, layer.kv,
                                             layer.scale, layer.gmax)
    width = layer.table.shape[1] * PAGE
    s = scores()
    slots = topk(s)
    want = K.topk_rows_ref(s, TOPK, block_table=layer.table, page_size=PAGE)[1]
    same = bool((slots.sort(dim=1).values == want.sort(dim=1).values).all())
    key_bytes = batch * context * (INDEX_DIM + 4)
    sel_bytes = batch * TOPK * (D * kv.element_size() + (4 if scale is not None else 0))
    tag = {"heads": heads, "batch": batch, "context": context, "index_topk": TOPK,
           "index_heads": INDEX_HEADS, "index_dim": INDEX_DIM, "kv_dtype": kind,
           "index_dtype": "fp8", "verified_topk": same, "topk_floor_group": layer.group}
    if configs:
        tag["configs"] = configs
    maxima_bytes = gmax.numel() * 4 if gmax is not None else 0
    runs = [("dsa_index_scores", scores, key_bytes + batch * width * 4 + maxima_bytes),
            ("dsa_topk", lambda: topk(s), batch * width * 4),
            ("dsa_sparse_mla", lambda: sparse(slots), sel_bytes),
            ("dsa_decode", lambda: sparse(topk(scores())), key_bytes + sel_bytes)]
    out = []
    for name, fn, nbytes in runs:
        rec = _record(name, bench_both(fn), nbytes, ceil, **tag)
        out.append(rec)
        print(json.dumps(rec), flush=True)
    return out


def prefill_scores(dev, gen, context: int, rows: int):
    """``index_scores`` over ``rows`` prefill rows of one request with a ``context``-token
    history (fp8 keys): a function of the launch config."""
    _, _, keys, key_scale, table = _pools(1, context, "fp8", dev, gen)
    iq = torch.randn(rows, INDEX_HEADS, INDEX_DIM, device=dev, dtype=torch.bfloat16,
                     generator=gen)
    w = torch.randn(rows, INDEX_HEADS, device=dev, generator=gen) * INDEX_HEADS ** -0.5
    lens = torch.full((1,), context, dtype=torch.int32, device=dev)
    starts = torch.tensor([0, rows], dtype=torch.int32, device=dev)

    def run(config: dict | None = None):
        return K.index_scores(iq, w, keys, table, lens, starts, INDEX_DIM ** -0.5,
                              table.shape[1] * PAGE, index_scale=key_scale, config=config,
                              max_rows=rows)
    return run


def _prefill_index_records(dev, gen, ceil, rows: int = 2048) -> list[dict]:
    """The indexer over a prefill chunk: ``rows`` rows of one request after a history, fp8
    keys (what a long prompt's chunks run), TFLOP/s of its e4m3 products beside the same run's
    bf16 matmul peak (the e4m3 peak is about twice that)."""
    out = []
    for context in (32768, 65536):
        run = prefill_scores(dev, gen, context, rows)

        seen = float(torch.isfinite(run()).sum())  # (row, token) pairs the rows see
        times = bench_both(run)
        tflops = 2 * INDEX_HEADS * INDEX_DIM * seen / times["ms"] / 1e9
        rec = {"kernel": "dsa_index_prefill", "rows": rows, "context": context,
               "index_heads": INDEX_HEADS, "index_dim": INDEX_DIM, "index_dtype": "fp8",
               "ms": round(times["ms"], 4), "ms_eager": round(times["ms_eager"], 4),
               "TFLOPs": round(tflops, 1),
               "ceiling_matmul_bf16_TFLOPs": round(ceil["matmul_TFLOPs"], 1)}
        out.append(rec)
        print(json.dumps(rec), flush=True)
    return out


def dsa_records(dev: torch.device, ceil: dict[str, float], kinds=("bf16", "fp8"),
                configs=None) -> list[dict]:
    """Records per (KV kind, heads, context): index_scores, topk_rows (winners checked against
    torch.topk of the same scores), mla_sparse, and the pipeline (``dsa_decode``); ``configs``
    (kernel -> launch config, e.g. a sweep's winners) overrides the tuning tables."""
    out = []
    gen = torch.Generator(device=dev).manual_seed(0)
    for kind in kinds:
        for heads, batch, context in SHAPES:
            out += _shape_records(dev, gen, ceil, kind, heads, batch, context, configs)
            torch.cuda.empty_cache()
    return out + _prefill_index_records(dev, gen, ceil)


def merge_dsa(path: str, dev: torch.device) -> None:
    """Replace the DSA records of the results file ``path`` (kept otherwise) with new ones."""
    try:
        with open(path) as f:
            result = json.load(f)
    except FileNotFoundError:
        result = {"records": []}
    ceil = ceilings(dev)
    result["records"] = [r for r in result["records"] if not r["kernel"].startswith("dsa_")]
    result["records"] += dsa_records(dev, ceil)
    result["dsa_date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    result["dsa_ceilings"] = {k: round(v, 1) for k, v in ceil.items()}
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("merged DSA records into", path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/dsa_kernels.py needs a GPU")
    K.set_value_checks(False)
    dev = torch.device("cuda")
    ceil = ceilings(dev)
    with open(args.out, "w") as f:
        json.dump({"ceilings": ceil, "records": dsa_records(dev, ceil)}, f, indent=1)


if __name__ == "__main__":
    main()
