"""DeepSeek Sparse Attention in the layouts: which KV slots each query row attends.

In a DSA model every layer stores an indexer key per token beside its latent row
(``store_rows``); a layer with an indexer scores the rows' queries against the keys of their
paged histories (``index_scores``), keeps the ``index_topk`` best positions each row sees
(``topk_rows``, which returns their slots) and attends only those (``attend(..., slots)``). A
layer without an indexer (GLM-5's "shared" layers) attends the slots the previous indexer layer
picked in the same step, remembered per call site in ``StepMeta.selection``.

While every context of the step is at most ``index_topk`` tokens, a row picks its whole
history, so dense attention is exact and no scoring runs (``StepMeta.within_topk``).

Position-sharded histories (CP decode) pick exactly in two rounds: each rank keeps its local
top-k (values and slots), the values are all-gathered, and every rank takes the same global
top-k of the T·k candidates; a rank then attends its own winners, and the partial results merge
by log-sum-exp as in dense CP. The global top-k of the union of local top-ks is the top-k of
the whole history.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import numpy as np
import torch

from splash.dist.comm import Comm
from splash.kernels_triton import index_scores, topk_rows
from splash.kernels_triton.dsa_index import tile_counts
from splash.kernels_triton.topk import FLOOR_GROUP, floor_group
from splash.layouts.base import KVStore, StepMeta

SCORE_BUDGET = 1 << 26  # fp32 scores (256 MiB) one index_scores call may write; rows beyond
# that run in pieces (long prefill chunks over long histories)


def pick_slots(store: KVStore, layer: int, attn: Any, x: torch.Tensor, q_in: torch.Tensor,
               positions: torch.Tensor, args: dict, meta: StepMeta, site: str,
               lens: tuple[list[int], list[int]] | None = None) -> torch.Tensor | None:
    """The (n, index_topk) KV slots (-1: none) rows ``x`` (n, hidden) attend in this layer, or
    None where attention is dense (not DSA, or every context within index_topk). ``q_in``: the
    rows' ``attn.q_input(x)``, computed for their queries already; ``args``: the rows' paged
    kernel arguments (``StepMeta.kernel_args``); ``site`` names the call site for the next
    shared layer; ``lens`` (rows per request, history per request) on the host lets a long
    prefill run in pieces."""
    if not attn.is_sparse or meta.within_topk(attn.cfg.index_topk):
        return None
    ix = attn.indexer
    if ix is None:
        return meta.selection[site]
    keys, key_scale = store.index_layer(layer)
    q = ix.query(q_in, positions)  # (n, HI, I)
    slots = topk_indexed(q, ix.head_weights(x), keys, key_scale, args, ix.softmax_scale,
                         ix.topk, store.configs, lens)[1]
    meta.selection[site] = slots
    return slots


def topk_indexed(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                 key_scale: torch.Tensor | None, args: dict, softmax_scale: float, k: int,
                 configs: dict[str, dict], lens: tuple[list[int], list[int]] | None = None,
                 budget: int = SCORE_BUDGET) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, slots) (n, k) of the k best-scoring positions each row sees."""
    table, page_size = args["block_table"], keys.shape[1]
    width = table.shape[1] * page_size
    score_cfg, topk_cfg = configs.get("index_scores") or None, configs.get("topk") or None
    group = floor_group(q.device, k, width, topk_cfg)

    def maxima(n: int) -> torch.Tensor | None:  # the indexer's group maxima: top-k's floor
        return torch.empty((n, -(-width // group)), dtype=torch.float32,
                           device=q.device) if group else None

    if q.shape[0] * width <= budget or lens is None:
        gmax = maxima(q.shape[0])
        scores = index_scores(q, weights, keys, table, args["seq_lens"], args["q_start_loc"],
                              softmax_scale, width, index_scale=key_scale, config=score_cfg,
                              max_rows=args.get("max_rows"), group_max=gmax, group=group)
        return topk_rows(scores, k, block_table=table, row_req=args.get("row_req"),
                         page_size=page_size, config=topk_cfg, floor_max=gmax)
    values = torch.empty((q.shape[0], k), dtype=torch.float32, device=q.device)
    slots = torch.empty((q.shape[0], k), dtype=torch.int32, device=q.device)

    def t(v: Any) -> torch.Tensor:
        return torch.as_tensor(np.asarray(v), device=q.device)

    for rows, reqs, seq_lens, q_start in _pieces(*lens, max(budget // width, 1)):
        rows_t, reqs_t = t(rows), t(reqs)
        sub_table = table[reqs_t]
        gmax = maxima(len(rows))
        scores = index_scores(q[rows_t], weights[rows_t], keys, sub_table,
                              t(seq_lens).to(torch.int32), t(q_start).to(torch.int32),
                              softmax_scale, width, index_scale=key_scale, config=score_cfg,
                              max_rows=max(int(np.diff(q_start).max()), 1), group_max=gmax,
                              group=group)
        row_req = t(np.repeat(np.arange(len(reqs)), np.diff(q_start))).to(torch.int32)
        values[rows_t], slots[rows_t] = topk_rows(scores, k, block_table=sub_table,
                                                  row_req=row_req, page_size=page_size,
                                                  config=topk_cfg, floor_max=gmax)
    return values, slots


def _pieces(q_lens: list[int], kv_lens: list[int], max_rows: int):
    """Groups of at most ``max_rows`` rows: (row indices, request of each piece, the piece's KV
    length (its last row's position + 1), piece row starts), cutting requests where needed."""
    group: tuple[list, list, list, list] = ([], [], [], [0])
    row0 = 0
    for b, (n, kv) in enumerate(zip(q_lens, kv_lens, strict=True)):
        lo = 0
        while lo < n:
            hi = min(n, lo + max_rows - len(group[0]))
            group[0].extend(range(row0 + lo, row0 + hi))
            group[1].append(b)
            group[2].append(kv - (n - hi))
            group[3].append(group[3][-1] + hi - lo)
            lo = hi
            if len(group[0]) == max_rows:
                yield group
                group = ([], [], [], [0])
        row0 += n
    if group[0]:
        yield group


def pick_slots_sharded(comm: Comm, store: KVStore, layer: int, attn: Any, x: torch.Tensor,
                       q_in: torch.Tensor, positions: torch.Tensor, args: dict, meta: StepMeta,
                       site: str) -> torch.Tensor | None:
    """``pick_slots`` for decode rows over position-sharded histories (CP): this rank's local
    slots among the global winners (-1 elsewhere). Every rank calls it with the same rows."""
    if not attn.is_sparse or meta.within_topk(attn.cfg.index_topk):
        return None
    ix = attn.indexer
    if ix is None:
        return meta.selection[site]
    keys, key_scale = store.index_layer(layer)
    q = ix.query(q_in, positions)
    values, local = topk_indexed(q, ix.head_weights(x), keys, key_scale, args, ix.softmax_scale,
                                 ix.topk, store.configs)  # (n, k) each
    n, k, world = values.shape[0], values.shape[1], comm.world
    candidates = comm.all_gather_same(values).permute(1, 0, 2).reshape(n, world * k)
    owned = torch.full((n, world, k), -1, dtype=torch.int32, device=values.device)
    owned[:, comm.rank] = local
    slots = topk_rows(candidates, k, index=owned.view(n, world * k),
                      config=store.configs.get("topk") or None)[1]
    meta.selection[site] = slots
    return slots


def warm_selection(store: KVStore, attn_layers: list, max_len: int, world: int) -> int:
    """Compile ahead the launch variants of the selection kernels that histories of up to
    ``max_len`` tokens reach, so that the first long request does not compile them
    mid-serving. A step's shape picks ``index_scores``' tiles per program (for decode rows and
    for prefill rows) and ``topk_rows``' passes (one chunk; the first, middle and last of
    several; CP's merge of the ranks' candidates); each runs once here on a one-page history,
    with the pools of the first indexer layer, the compilations in parallel threads on a GPU.
    Returns the number of launches (0: no indexer, or every history within ``index_topk``,
    where attention stays dense)."""
    layer = next((i for i, a in enumerate(attn_layers) if a.indexer is not None), None)
    if layer is None or max_len <= attn_layers[layer].indexer.topk:
        return 0
    ix = attn_layers[layer].indexer
    keys, key_scale = store.index_layer(layer)
    dev, k, page_size = keys.device, ix.topk, keys.shape[1]
    score_cfg, topk_cfg = store.configs.get("index_scores") or {}, store.configs.get("topk")
    q = torch.zeros((2, ix.num_heads, ix.head_dim), dtype=ix.wq_b.dtype, device=dev)
    weights = torch.zeros((2, ix.num_heads), dtype=torch.float32, device=dev)
    one = torch.ones(1, dtype=torch.int32, device=dev)
    table = torch.zeros((1, -(-max(max_len, 1) // page_size)), dtype=torch.int32, device=dev)
    width = table.shape[1] * page_size  # whole pages, as every step's history bound
    gen = torch.Generator(device=dev).manual_seed(0)
    launches: list[Callable[[], Any]] = []
    # lengths in whole pages, as steps score: one pass; several without the floor (too few
    # groups for one); every pass kind, the floor too
    one_chunk = min(width, -(-2 * k // page_size) * page_size)
    no_floor = min(width, max(FLOOR_GROUP * k // page_size, 1) * page_size)
    lengths = sorted({one_chunk, no_floor, width})
    groups = {floor_group(dev, k, n, topk_cfg) for n in lengths}  # with and without maxima
    for rows, group in itertools.product((1, 2), groups):  # decode rows; prefill row blocks
        starts = torch.tensor([0, rows], dtype=torch.int32, device=dev)
        gmax = torch.empty((rows, -(-width // group)), device=dev) if group else None
        launches += [partial(index_scores, q[:rows], weights[:rows], keys, table, one, starts,
                             ix.softmax_scale, width, index_scale=key_scale,
                             config={**score_cfg, "TILES": tiles}, group_max=gmax, group=group)
                     for tiles in tile_counts(dev, score_cfg or None)]
    for length in lengths:
        scores = torch.randn((1, length), generator=gen, device=dev)
        group = floor_group(dev, k, length, topk_cfg)
        floor = torch.randn((1, -(-length // group)), generator=gen, device=dev) if group else None
        launches += [partial(topk_rows, scores, k, block_table=table, row_req=row_req,
                             page_size=page_size, config=topk_cfg, floor_max=floor)
                     for row_req in (None, one - 1)]
    if world > 1:  # CP: the global top-k of the ranks' candidates
        candidates = torch.randn((1, world * k), generator=gen, device=dev)
        owned = torch.zeros((1, world * k), dtype=torch.int32, device=dev)
        launches.append(partial(topk_rows, candidates, k, index=owned, config=topk_cfg))
    _run_all(launches, dev)
    return len(launches)


def _run_all(launches: list[Callable[[], Any]], dev: torch.device) -> None:
    """Run ``launches``; on a GPU from threads, so that their compilations overlap."""
    if dev.type != "cuda":
        for launch in launches:
            launch()
        return

    def run(launch: Callable[[], Any]) -> None:
        with torch.cuda.device(dev), torch.inference_mode():
            launch()

    with ThreadPoolExecutor(max_workers=min(8, len(launches))) as pool:
        list(pool.map(run, launches))
