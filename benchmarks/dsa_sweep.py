"""Launch-parameter sweep of the DSA decode kernels on the GPU, then the ``dsa_kernels.py``
records with each kernel's winner.

Swept at batch 16, DeepSeek-V3.2 dims (see ``dsa_kernels.py``), CUDA-graph medians (eager
times carry the launches' host cost, which decides nothing about a graph-replayed step):
- ``index_scores`` (fp8 keys): fp16 or e4m3 products × queries or keys on M × BLOCK_T ×
  TILES × num_warps × num_stages at 32K and 128K;
- ``index_scores`` e4m3 products with the keys on M only (``--only index_tiles``): BLOCK_T ×
  TILES × num_warps × num_stages, finer and deeper than the above;
- ``index_scores`` with page ids gathered from registers (``--only index_gather``, a study):
  tiles per program × stages; two stages with fewer tiles a program, more programs an SM in
  one wave (``--only index_occupancy``, a study); tiles a program of any count, for one
  wave of three programs an SM (``--only index_wave``, a study);
- ``index_scores`` over a 2,048-row prefill chunk (``--only index_prefill``, a study): rows a
  block × warps × BLOCK_T × stages, at 32K and 64K history;
- ``topk_rows`` at 32K and 128K, split passes: without the floor, then with the indexer's
  group maxima folded to FLOOR_N × false-position rounds for the floor × parts, 8K and 16K
  chunks; on scores with a trend along the history (``--only topk_ramp``, a study: the floor
  loose, the last pass's exact fallback), without the floor and with the default; the
  floor's survivors searched first in 4K registers or not (``--only topk_survivors``, a study,
  both score kinds);
- ``mla_sparse`` at 128 heads (``--only sparse_splits``) and at 16 (``--only
  sparse_splits_few``), studies whose winners feed no record: num_splits × tiles × stages;
  at 16 heads with tiles and stages that leave room for two programs an SM (``--only
  sparse_occupancy``, a study);
- ``mla_sparse`` over 2,048 selected slots, 16 and 128 heads, bf16 and fp8 KV: BLOCK_N ×
  num_warps × num_stages; with the slot ids gathered (``--only sparse_gather``, a study);
  in four column chunks of the latent dims or not (``--only sparse_chunks``, a study);
  over a 2,048-row prefill chunk at 128 heads (``--only sparse_prefill``, a study).
A config is the winner of a kernel when its summed time over the swept shapes is lowest
(configs that fail to compile or give wrong results are reported and skipped). The records then
run with the winners: ``python benchmarks/dsa_sweep.py --out sweep.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import triton
from _resources import compiled_resources
from _results import save_json  # noqa: E402  (benchmarks/ is on sys.path)
from _timing import ceilings  # noqa: E402
from dsa_kernels import (
    INDEX_DIM,
    INDEX_HEADS,
    PAGE,
    SM_SCALE,
    TOPK,
    D,
    L,
    _pools,
    dsa_records,
    prefill_scores,
)
from triton.testing import do_bench_cudagraph

import splash.kernels_triton as K
from splash.kernels_triton.topk import floor_group

BATCH = 16
PREFILL_ROWS = 2048
INDEX_SPACE = [{"BLOCK_T": t, "TILES": n, "num_warps": w, "num_stages": st, "fp8_dot": e4m3,
                "tokens_m": tm}
               for e4m3, tm, t, n, w, st in itertools.product((False, True), (False, True),
                                                              (128, 256), (4, 16), (4, 8), (2, 3))]
# the e4m3 products with the keys on M (the winners of INDEX_SPACE) over finer tiles per
# program and deeper pipelines: ``--only index_tiles``
INDEX_TILES_SPACE = [{"BLOCK_T": t, "TILES": n, "num_warps": w, "num_stages": st, "fp8_dot": True,
                      "tokens_m": True}
                     for t, n, w, st in itertools.product((64, 128, 256), (4, 8, 16, 32), (4, 8),
                                                          (2, 3, 4))]
# the page ids gathered from registers (``gather_pages``: the copies then pipeline) with
# deeper pipelines and tiles per program: ``--only index_gather``, against the default (its
# first row)
INDEX_GATHER_SPACE = [{}] + [{"gather_pages": True, "TILES": n, "num_stages": st}
                             for n, st in itertools.product((None, 4, 8, 16, 32), (3, 4))] + [
    {"gather_pages": True, "BLOCK_T": 64, "TILES": n, "num_stages": st}
    for n, st in itertools.product((16, 32), (3, 4))]  # 64-token tiles: 78 registers, 33 / 41 KB
# of shared memory at 3 / 4 stages (offline sm_90): 6 / 5 programs an SM, against 4
# two stages (about 40 KB of shared memory: five programs an SM, where three stages' 58 KB
# hold three once the driver's 1 KB a program is counted) with fewer tiles a program, so
# more programs fill the SMs in one wave: ``--only index_occupancy``, against the default
INDEX_OCCUPANCY_SPACE = [{}] + [{"num_stages": 2, "TILES": n} for n in (4, 8, 16)] + [
    {"num_stages": 3, "TILES": 8}]
# tiles a program for one wave of three programs an SM (the 3-stage kernel's shared memory),
# any count, against the default's power of two (its first row): ``--only index_wave``, a study.
# 32K: 11 / 12 tiles give 384 / 352 programs (10: 416, past one wave); 128K: 43 / 44 give 384
INDEX_WAVE_SPACE = [{}] + [{"TILES": n} for n in (10, 11, 12, 14, 21, 22, 42, 43, 44, 86)]
# prefill row blocks (``--only index_prefill``): rows a block x warps x tile x stages
INDEX_PREFILL_SPACE = [{"BLOCK_M_EXTEND": m, "num_warps_extend": w, "BLOCK_T": t,
                        "num_stages": st}
                       for m, w, t, st in itertools.product((2, 4, 8), (4, 8, 16), (64, 128),
                                                            (2, 3))]
TOPK_SPACE = [{"CHUNK": 8192, "PARTS": 8, "place_warps": 4, "num_warps": 8, "FLOOR_N": 1}] + [  # the split passes without the floor (FLOOR_N <= k), then with
    {"CHUNK": c, "PARTS": p, "place_warps": 4, "num_warps": w, "FLOOR_N": n,
     "FLOOR_ROUNDS": r}  # the indexer's group maxima: their fold and false-position rounds
    for (c, w), p, n, r in itertools.product(((8192, 8), (16384, 16)), (4, 8), (4096, 8192),
                                             (3, 6))
    if (c == 8192 and (n == 4096 or p == 8)) or (p == 8 and n == 4096 and r == 3)]
# the floor's survivors searched in a chunk's registers or first in 4K (``SURVIVOR_CHUNK``,
# the default), on the indexer's scores and on a trend: ``--only topk_survivors``
TOPK_SURVIVORS_SPACE = [{"SURVIVOR_CHUNK": None}, {}]
# the split of each row's slot list at 128 heads (None: the launcher's choice) with the table's
# tiles and deeper ones: ``--only sparse_splits``
SPARSE_SPLITS_SPACE = [{"num_splits": s, **cfg} for s in (None, 2, 4, 8, 16)
                       for cfg in ({}, {"num_stages": 3}, {"BLOCK_N": 32, "num_stages": 3})]
# the same at 16 heads, to 32 splits: ``--only sparse_splits_few``
SPARSE_SPLITS_FEW = [{"num_splits": s, **cfg} for s in (None, 2, 4, 8, 16, 32)
                     for cfg in ({}, {"num_stages": 3}, {"BLOCK_N": 32, "num_stages": 3})]
# few heads with shared memory for two programs an SM (32-token tiles or 2 stages) and more
# splits to fill them: ``--only sparse_occupancy``, against the default (its first row)
SPARSE_OCCUPANCY_SPACE = [{}] + [{"num_splits": sp, "BLOCK_N": n, "num_stages": st}
                                 for sp in (None, 16) for n, st in ((64, 3), (32, 3), (32, 4),
                                                                    (64, 2))][1:]
# the split's slot ids gathered from registers (``gather_slots``: the copies then pipeline),
# with deeper pipelines: ``--only sparse_gather``, against the default (its first row)
SPARSE_GATHER_SPACE = [{}] + [{"gather_slots": True, "num_stages": st, "num_splits": n}
                              for st, n in itertools.product((2, 3, 4), (None, 16))]
# the latent dims in four column chunks, against one 576-wide tile (its first row), with the
# table's tiles and others: ``--only sparse_chunks``
SPARSE_CHUNKS_SPACE = [{"dim_chunks": False}, {}] + [
    {"dim_chunks": True, "BLOCK_N": n, "num_stages": st, "num_warps": w}
    for n, st, w in ((32, 3, 8), (64, 2, 8), (64, 3, 8), (64, 3, 4), (64, 2, 4))]
SPARSE_SPACE = [{"BLOCK_N": n, "num_warps": w, "num_stages": st}
                for n, w, st in itertools.product((16, 32, 64), (4, 8), (1, 2))]
# 128 heads over a prefill chunk's rows (``--only sparse_prefill``, a study): 20 of a 128K
# prompt's 61 ms a chunk (4 layers) at ~234 TFLOP/s
SPARSE_PREFILL_SPACE = [{}] + [{"BLOCK_N": n, "num_warps": w, "num_stages": st,
                                "gather_slots": g}
                               for n, w, st, g in itertools.product((32, 64), (4, 8), (1, 2, 3),
                                                                    (False, True))]


def _close_scores(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """Same unseen pattern, finite scores within 5% of the largest (e4m3 queries round each
    query entry to 3 mantissa bits; fp16 ones agree to ~1e-3)."""
    seen = torch.isfinite(ref)
    if not torch.equal(seen, torch.isfinite(out)):
        return False
    return bool((out[seen] - ref[seen]).abs().max() <= 0.05 * ref[seen].abs().max())


def _time(fn, check) -> float | str:
    try:
        out = fn()
        if not check(out):
            return "wrong result"
        return round(float(do_bench_cudagraph(fn, rep=20, return_mode="median")), 4)
    except Exception as exc:  # noqa: BLE001 - a config that does not build is reported
        torch.cuda.synchronize()
        return repr(exc)[:160]


def _topk_shape(scores: torch.Tensor, table: torch.Tensor, width: int, dev) -> tuple:
    """``topk_rows`` of ``scores`` with the indexer's group maxima as its floor where the
    config takes one, as a function of the config, and its check against torch.topk."""
    want = K.topk_rows_ref(scores, TOPK, block_table=table, page_size=PAGE)[1].sort(1).values
    pad = torch.full((scores.shape[0], -width % 8), float("-inf"), device=dev)
    gmax = torch.cat((scores, pad), 1).view(scores.shape[0], -1, 8).amax(2)

    def topk(cfg):
        floor = gmax if floor_group(dev, TOPK, width, cfg) else None
        return K.topk_rows(scores, TOPK, block_table=table, page_size=PAGE, config=cfg,
                           floor_max=floor)[1]
    return topk, lambda out: bool((out.sort(1).values == want).all())


def _sweep(name: str, space: list[dict], shapes: dict[str, tuple]) -> dict:
    """Times every config of ``space`` on every shape (``tag -> (fn(config), check)``)."""
    rows, best, best_ms = [], None, float("inf")
    for cfg in space:
        times = {tag: _time(lambda fn=fn, cfg=cfg: fn(cfg), check)
                 for tag, (fn, check) in shapes.items()}
        rows.append({"config": cfg, "ms": times})
        print(name, json.dumps(rows[-1]), flush=True)
        if all(isinstance(t, float) for t in times.values()) and sum(times.values()) < best_ms:
            best, best_ms = cfg, sum(times.values())
    return {"rows": rows, "best": best, "best_total_ms": round(best_ms, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", default="index_scores,topk,mla_sparse")
    parser.add_argument("--no-records", action="store_true", help="sweeps only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/dsa_sweep.py needs a GPU")
    K.set_value_checks(False)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    index_shapes, topk_shapes, topk_ramp_shapes, sparse_shapes = {}, {}, {}, {}
    for context in (32768, 131072):
        kv, scale, keys, key_scale, table = _pools(BATCH, context, "fp8", dev, gen)
        iq = torch.randn(BATCH, INDEX_HEADS, INDEX_DIM, device=dev, dtype=torch.bfloat16,
                         generator=gen)
        w = torch.randn(BATCH, INDEX_HEADS, device=dev, generator=gen) * INDEX_HEADS ** -0.5
        lens = torch.full((BATCH,), context, dtype=torch.int32, device=dev)
        starts = torch.arange(BATCH + 1, dtype=torch.int32, device=dev)
        width = table.shape[1] * PAGE
        ref = K.index_scores(iq, w, keys, table, lens, starts, INDEX_DIM ** -0.5, width,
                             index_scale=key_scale, max_rows=1)

        def scores(cfg, iq=iq, w=w, keys=keys, table=table, lens=lens, starts=starts,
                   width=width, key_scale=key_scale):
            return K.index_scores(iq, w, keys, table, lens, starts, INDEX_DIM ** -0.5, width,
                                  index_scale=key_scale, config=cfg, max_rows=1)

        index_shapes[f"{context}"] = (scores, lambda out, ref=ref: _close_scores(out, ref))
        topk_shapes[f"{context}"] = _topk_shape(ref, table, width, dev)
        # a trend along the history (recency: scores rising to 4 standard deviations at the
        # end): consecutive tokens' group maxima then bound the k-th largest loosely
        ramp = torch.linspace(0, 4, width, device=dev) * ref[torch.isfinite(ref)].std()
        topk_ramp_shapes[f"{context}-ramp"] = _topk_shape(ref + ramp, table, width, dev)
        if context == 32768:
            slots = topk_shapes[f"{context}"][0](None)
            for heads, kind in itertools.product((16, 128), ("bf16", "fp8")):
                q = torch.randn(BATCH, heads, D, device=dev, dtype=torch.bfloat16, generator=gen)
                kvk, sck = (kv, scale) if kind == "fp8" else _pools(BATCH, context, kind, dev,
                                                                    gen)[:2]
                base = K.mla_sparse(q, kvk, slots, SM_SCALE, L, kv_scale=sck)[0]

                def sparse(cfg, q=q, kvk=kvk, sck=sck, slots=slots):
                    cfg = dict(cfg or {})
                    splits = cfg.pop("num_splits", None)
                    return K.mla_sparse(q, kvk, slots, SM_SCALE, L, kv_scale=sck,
                                        num_splits=splits, config=cfg)[0]

                sparse_shapes[f"{heads}h-{kind}"] = (sparse, lambda out, base=base: bool(
                    torch.allclose(out.float(), base.float(), rtol=2e-2, atol=2e-2)))
    only = args.only.split(",")
    sparse_prefill = {}  # the prefill studies' inputs, built only when they run
    for kind in ("bf16", "fp8") if "sparse_prefill" in only else ():
        kvk, sck, _, _, table = _pools(1, 65536, kind, dev, gen)
        pos = torch.randint(0, 65536, (PREFILL_ROWS, TOPK), device=dev, generator=gen)
        slots = (table[0].long()[pos // PAGE] * PAGE + pos % PAGE).to(torch.int32)
        q = torch.randn(PREFILL_ROWS, 128, D, device=dev, dtype=torch.bfloat16, generator=gen)

        def sparse_rows(cfg, q=q, kvk=kvk, sck=sck, slots=slots):
            return K.mla_sparse(q, kvk, slots, SM_SCALE, L, kv_scale=sck, config=cfg)[0]

        sparse_prefill[f"128h-{kind}"] = (sparse_rows, lambda out, base=sparse_rows(None): bool(
            torch.allclose(out.float(), base.float(), rtol=2e-2, atol=2e-2)))
    prefill_shapes = {}
    for context in (32768, 65536) if "index_prefill" in only else ():
        prefill = prefill_scores(dev, gen, context, PREFILL_ROWS)
        prefill_shapes[f"{context}"] = (prefill, lambda out, ref=prefill(None): _close_scores(
            out, ref))
    result: dict = {"triton": triton.__version__, "batch": BATCH, "sweeps": {}}
    many_heads = {t: f for t, f in sparse_shapes.items() if t.startswith("128h")}
    few_heads = {t: f for t, f in sparse_shapes.items() if t.startswith("16h")}
    winners = {}  # kernel -> the winning launch config (a study's sweep sets none)
    for name, kernel, space, shapes in (
            ("index_scores", "index_scores", INDEX_SPACE, index_shapes),
            ("index_tiles", "index_scores", INDEX_TILES_SPACE, index_shapes),
            ("index_gather", None, INDEX_GATHER_SPACE, index_shapes),
            ("index_occupancy", None, INDEX_OCCUPANCY_SPACE, index_shapes),
            ("index_wave", None, INDEX_WAVE_SPACE, index_shapes),
            ("index_prefill", None, INDEX_PREFILL_SPACE, prefill_shapes),
            ("topk", "topk", TOPK_SPACE, topk_shapes),
            ("topk_ramp", None, TOPK_SPACE[:1] + [{}], topk_ramp_shapes),
            ("topk_survivors", None, TOPK_SURVIVORS_SPACE, {**topk_shapes, **topk_ramp_shapes}),
            ("mla_sparse", "mla_sparse", SPARSE_SPACE, sparse_shapes),
            ("sparse_splits", None, SPARSE_SPLITS_SPACE, many_heads),
            ("sparse_splits_few", None, SPARSE_SPLITS_FEW, few_heads),
            ("sparse_occupancy", None, SPARSE_OCCUPANCY_SPACE, few_heads),
            ("sparse_gather", None, SPARSE_GATHER_SPACE, sparse_shapes),
            ("sparse_chunks", None, SPARSE_CHUNKS_SPACE, sparse_shapes),
            ("sparse_prefill", None, SPARSE_PREFILL_SPACE, sparse_prefill)):
        if name in only:
            result["sweeps"][name] = _sweep(name, space, shapes)
            save_json(args.out, result)
            if kernel and result["sweeps"][name]["best"]:
                winners[kernel] = result["sweeps"][name]["best"]
    result["kernels"] = compiled_resources(dev)  # what the compiler gave every variant run
    save_json(args.out, result)
    del index_shapes, topk_shapes, topk_ramp_shapes, sparse_shapes, many_heads, few_heads
    torch.cuda.empty_cache()
    if args.no_records:
        return
    ceil = ceilings(dev)
    result["ceilings"] = ceil
    result["records"] = dsa_records(dev, ceil, configs=winners)
    save_json(args.out, result)
    print("winners", json.dumps(winners))


if __name__ == "__main__":
    main()
