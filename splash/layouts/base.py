"""What every layout's attention forward shares: the step's metadata on this rank, and
`attend`, which runs the paged MLA kernels for a subset of requests.

A layout is a small class with two methods: ``inputs(meta)`` builds the step's device tensors
(write slots, block tables, row permutations) once per step, and ``forward(layer, attn, h,
meta) -> (N, hidden)`` uses them; on entry every rank holds the full hidden states of the step
(the invariant every layout keeps), on exit every rank holds the attention output of every row. Keeping the
inputs apart lets a CUDA-graph replay refill them in place (``splash/engine/graphs.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from splash.core.ownership import Layout, holds, local_kv_len, local_page_index
from splash.core.protocol import StepPlan
from splash.dist.comm import Comm
from splash.dist.host_copy import to_device
from splash.kernels_triton import (
    gather_rows,
    kv_write,
    mla_decode,
    mla_extend,
    mla_sparse,
    scatter_rows,
)


class StepMeta:
    """Per-step, per-rank view of the batch. Built once per step; tensors cached by key."""

    def __init__(
        self,
        plan: StepPlan,
        tables: dict[str, list[int]],
        rank: int,
        world: int,
        page_size: int,
        device: torch.device,
        table_width: int = 0,
    ) -> None:
        self.plan, self.rank, self.world = plan, rank, world
        self.page_size, self.device = page_size, device
        self.table_width = table_width  # block tables at least this wide (CUDA graphs)
        self.num_requests = len(plan.request_ids)
        self.tables = [tables.get(rid, []) for rid in plan.request_ids]
        starts = [0]
        for n in plan.query_lens:
            starts.append(starts[-1] + n)
        self.row_start = starts
        self.positions = to_device(torch.tensor(plan.positions, dtype=torch.long), device)
        self.all_decode = all(n == 1 for n in plan.query_lens)
        self.selection: dict[str, torch.Tensor] = {}  # DSA: the last indexer layer's picks
        self._cache: dict[Any, Any] = {}

    def cached(self, key: Any, build: Callable[[], Any]) -> Any:
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def inputs(self, impl: AttentionLayout) -> dict[str, Any]:
        """``impl.inputs(self)``, built once per step (graph replays preset it)."""
        return self.cached(("inputs", impl.layout.name), lambda: impl.inputs(self))

    def within_topk(self, topk: int) -> bool:
        """Whether every context of the step is at most ``topk`` tokens (DSA then attends whole
        histories). Under CUDA graphs it follows the padded table width, part of the graph's
        key, so a captured choice holds for every step the graph replays."""
        if self.table_width:
            return self.table_width * self.page_size <= topk
        return max(self.plan.context_lens, default=0) <= topk

    def host_lens(self, reqs: list[int]) -> tuple[list[int], list[int]]:
        """(rows, history length) per request of ``reqs``, on the host."""
        return ([self.plan.query_lens[b] for b in reqs], [self.plan.context_lens[b] for b in reqs])

    def owned_rows(self) -> list[int]:
        """Rows owned by each rank (host list)."""
        counts = [0] * self.world
        for owner, n in zip(self.plan.owners, self.plan.query_lens, strict=True):
            counts[owner] += n
        return counts

    def rows(self, reqs: list[int]) -> torch.Tensor:
        """Row indices (in step order) of the requests ``reqs``."""
        idx = [i for b in reqs for i in range(self.row_start[b], self.row_start[b + 1])]
        return to_device(torch.tensor(idx, dtype=torch.long), self.device)

    def owned(self, rank: int) -> list[int]:
        return [b for b, o in enumerate(self.plan.owners) if o == rank]

    def write_slots(self, layout: Layout, reqs: list[int]) -> torch.Tensor:
        """Slot on this rank of each row of ``reqs``; -1 where this rank does not hold it (or
        the request has no page there: the padding rows of a CUDA-graph step). Vectorised over
        rows (numpy): this runs once per step on the hot path."""
        if not reqs:
            return torch.empty(0, dtype=torch.long, device=self.device)
        ps, world, plan = self.page_size, self.world, self.plan
        qlens = np.array([plan.query_lens[b] for b in reqs])
        row_req = np.repeat(np.arange(len(reqs)), qlens)  # request of each row
        rows = np.concatenate([np.arange(self.row_start[b], self.row_start[b + 1]) for b in reqs])
        pos = np.asarray(plan.positions, dtype=np.int64)[rows]
        logical = pos // ps
        owners = np.array([plan.owners[b] for b in reqs])[row_req]
        mine = holds(layout, self.rank, logical, owners, world)
        local = local_page_index(layout, logical, world)
        lengths = np.array([len(self.tables[b]) for b in reqs])
        mine &= local < lengths[row_req]
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        flat = np.concatenate([np.asarray(self.tables[b], dtype=np.int64) for b in reqs] +
                              [np.zeros(1, dtype=np.int64)])
        slots = np.full(len(pos), -1, dtype=np.int64)
        slots[mine] = flat[offsets[row_req[mine]] + local[mine]] * ps + pos[mine] % ps
        return torch.from_numpy(slots).to(self.device)

    def kernel_args(self, layout: Layout, reqs: list[int]) -> dict[str, Any]:
        """Block table, local KV lengths and query offsets of ``reqs`` on this rank."""
        lens = local_kv_len(layout, np.array([self.plan.context_lens[b] for b in reqs]),
                            self.rank, np.array([self.plan.owners[b] for b in reqs]),
                            self.world, self.page_size)
        width = max([len(self.tables[b]) for b in reqs] + [1, self.table_width])
        table = np.zeros((len(reqs), width), dtype=np.int32)
        for j, b in enumerate(reqs):
            table[j, : len(self.tables[b])] = self.tables[b]
        q_lens = [self.plan.query_lens[b] for b in reqs]
        q_start = np.concatenate([[0], np.cumsum(q_lens)])
        args = {
            "block_table": torch.from_numpy(table).to(self.device),
            "seq_lens": torch.from_numpy(lens.astype(np.int32)).to(self.device),
            "q_start_loc": torch.from_numpy(q_start.astype(np.int32)).to(self.device),
            "decode": all(n == 1 for n in q_lens),
            "max_rows": max(q_lens, default=1),  # the most rows of a request: the kernels' grids
        }
        if not args["decode"]:  # the request of each row (DSA's top-k turns positions to slots)
            row_req = np.repeat(np.arange(len(reqs), dtype=np.int32), q_lens)
            args["row_req"] = torch.from_numpy(row_req).to(self.device)
        return args


class KVStore:
    """This rank's KV pools: one (P, PS, D) tensor per layer (+ fp8 scales (P, PS)); for DSA
    models, per indexer layer, the indexer keys (P, PS, I) (+ fp8 scales) in the same pages and
    slots as the latent rows (None in other layers); and the backend's launch parameters of the
    attention kernels (``backends/``' TUNING tables)."""

    def __init__(self, caches: list[torch.Tensor], scales: list[torch.Tensor] | None,
                 configs: dict[str, dict] | None = None,
                 index_caches: list[torch.Tensor | None] | None = None,
                 index_scales: list[torch.Tensor | None] | None = None) -> None:
        self.caches, self.scales = caches, scales
        self.configs = configs or {}
        self.index_caches = index_caches or [None] * len(caches)
        self.index_scales = index_scales or [None] * len(caches)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.caches[i], (self.scales[i] if self.scales is not None else None)

    def index_layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        cache = self.index_caches[i]
        if cache is None:
            raise ValueError(f"layer {i} stores no indexer keys")
        return cache, self.index_scales[i]

    def slot_pools(self, i: int) -> list[torch.Tensor]:
        """Every pool of layer i indexed by slot (P, PS, ...): what a switch moves per row."""
        pools = [self.caches[i], self.scales[i] if self.scales is not None else None,
                 self.index_caches[i], self.index_scales[i]]
        return [p for p in pools if p is not None]

    def slot_kinds(self, layers: list[int]) -> list[list[torch.Tensor]]:
        """``slot_pools`` of ``layers`` kind by kind: the latent rows, fp8 scales, indexer keys
        and their scales of every layer that has them (a switch packs a kind at once)."""
        none: list[torch.Tensor | None] = [None] * len(self.caches)
        kinds: list[list[torch.Tensor] | list[torch.Tensor | None]] = [
            self.caches, self.scales or none, self.index_caches, self.index_scales]
        return [[t for t in (k[i] for i in layers) if t is not None] for k in kinds]

    def copy_pages(self, pairs: list[list[int]], layers: range | None = None) -> None:
        """Copy whole pages of every slot pool (rows, fp8 scales, indexer keys; bit-exact) of
        ``layers`` (default all): [src, dst] pairs, dst pages distinct (copy-on-write of pages
        shared by several requests)."""
        if not pairs:
            return
        device = self.caches[0].device
        both = to_device(torch.tensor(pairs, dtype=torch.long), device)  # waits for nothing
        src, dst = both[:, 0], both[:, 1]
        for i in layers if layers is not None else range(len(self.caches)):
            for pool in self.slot_pools(i):
                pages = pool.view(pool.shape[0], -1).view(torch.uint8)  # (P, page bytes)
                scatter_rows(pages, dst, gather_rows(pages, src))


def query(attn: Any, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_input(x), query(x)): the absorbed queries of rows ``x`` and the normalised q_a latent
    they came from, which a DSA layer's indexer reads too."""
    q_in = attn.q_input(x)
    return q_in, attn.query(x, positions, q_in)


def store_rows(store: KVStore, layer: int, attn: Any, x: torch.Tensor, positions: torch.Tensor,
               slots: torch.Tensor) -> None:
    """Write the latent KV rows of rows ``x`` (n, hidden) at ``slots`` (-1 skips), and in a DSA
    indexer layer their indexer keys in the same slots."""
    cache, scale = store.layer(layer)
    kv_write(cache, attn.latent(x, positions), slots, kv_scale=scale)
    if attn.indexer is not None:
        keys, key_scale = store.index_layer(layer)
        kv_write(keys, attn.indexer.key(x, positions), slots, kv_scale=key_scale)


def attend(
    q: torch.Tensor, store: KVStore, layer: int, args: dict, sm_scale: float, kv_lora_rank: int,
    slots: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged absorbed attention of rows ``q`` (n, h, D) → (o (n, h, L), lse (n, h)): over each
    row's causal history, or only over ``slots`` (n, K) (DSA's selection) when given."""
    cache, scale = store.layer(layer)
    if slots is not None:
        return mla_sparse(q, cache, slots, sm_scale, kv_lora_rank, kv_scale=scale,
                          config=store.configs.get("mla_sparse") or None)
    if args["decode"]:
        return mla_decode(q, cache, args["block_table"], args["seq_lens"], sm_scale,
                          kv_lora_rank, kv_scale=scale,
                          config=store.configs.get("mla_decode") or None)
    return mla_extend(q, cache, args["block_table"], args["seq_lens"], args["q_start_loc"],
                      sm_scale, kv_lora_rank, kv_scale=scale,
                      config=store.configs.get("mla_extend") or None,
                      max_rows=args.get("max_rows"))


class AttentionLayout(ABC):
    """Contract: ``forward`` computes one layer's attention output for every row of the step,
    on every rank, using only this rank's placed heads and KV pages plus collectives."""

    layout: Layout

    def __init__(self, comm: Comm, store: KVStore, kv_lora_rank: int) -> None:
        self.comm, self.store, self.kv_lora_rank = comm, store, kv_lora_rank

    @abstractmethod
    def inputs(self, meta: StepMeta) -> dict[str, Any]:
        """The step's device tensors (and host values) ``forward`` needs, built once."""

    def owner_inputs(self, meta: StepMeta) -> dict[str, Any]:
        """Owner-held KV (DP, DOP): rows in owner order (``perm``) and, where this rank owns
        rows, their indices, write slots and kernel arguments."""
        owned = [meta.owned(r) for r in range(self.comm.world)]
        mine = owned[self.comm.rank]
        inp: dict[str, Any] = {"perm": meta.rows([b for reqs in owned for b in reqs])}
        if mine:
            inp.update(rows=meta.rows(mine), slots=meta.write_slots(self.layout, mine),
                       args=meta.kernel_args(self.layout, mine))
        return inp

    @abstractmethod
    def forward(self, layer: int, attn: Any, h: torch.Tensor, meta: StepMeta) -> torch.Tensor:
        """h (N, hidden) normalised hidden states of every row → (N, hidden)."""
