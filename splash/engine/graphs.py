"""CUDA graphs for decode steps, one set per layout (paper §G).

A decode step launches a few hundred small kernels (projections, the MLA kernels, MoE, norms),
so at small batches the host's launch time, not the GPU, sets the step time. A worker replays a
captured graph of the whole model forward instead:

- **Shapes are padded to buckets.** The batch is padded with *ghost* requests (no pages, KV
  length 0, never sampled: their KV writes are skipped and their attention output is 0) to the
  next batch bucket; for owner-held layouts (DP, DOP) every rank is padded to the same row
  count. Block tables are padded to a power-of-two width (from the longest context in the
  plan: the same on every rank). A graph is keyed by
  ``(layout, padded batch, table width)``.
- **Inputs live in static buffers.** Each layout builds its step tensors in ``inputs(meta)``
  (``splash/layouts``); a replay builds them for the new step and copies them into the buffers
  the graph was captured with (token ids and positions too), then replays.
- **A layout switch invalidates nothing.** Graphs read the KV pools (allocated once) and the
  placed attention weights, which ``MLAAttention`` keeps in one buffer per head range for the
  engine's life: switching back to a layout reuses the very tensors its graphs were captured
  with. A step whose switch transfer interleaves with its layers (live mode), or any prefill,
  runs eagerly; a background handoff or a blocking switch completes its transfer first and
  then replays the destination's graph.
- ``capture=False`` pads the same way but runs the padded step eagerly: the padding's
  semantics can then be tested on any backend (``SPLASH_PAD_DECODE=1``).
- **At start-up** every worker captures every batch bucket of every layout it holds the
  placement for (at T = 1 all four; at T > 1 those sharing the start layout's projection
  placement: the others' heads arrive with the first switch to them) at one block-table width,
  the one covering contexts up to ``graph_context`` tokens (`startup_graph_keys`: the same list
  in the same order on every rank). That width is also the smallest any key takes, so every
  decode step with contexts up to ``graph_context`` replays a start-up graph. Keys met later
  (longer contexts, the other placement) are captured lazily, the first time they are seen
  (logged with the capture time). All graphs
  share one memory pool (replays never overlap; each replay's output is consumed before the
  next); the least recently used are dropped past ``max_graphs``.
- **Several ranks** (NCCL): every rank derives the same key from the same plan, so all capture
  and replay together. Collectives inside graphs use a communicator of their own (warmed up by
  the eager warm-up forward before capture, since NCCL connects lazily); capture uses
  ``thread_local`` error mode so other threads' CUDA calls (the NCCL watchdog, switch transfers)
  cannot invalidate it; after capturing, the ranks agree (an eager all-reduce) that every one
  succeeded, and otherwise all drop the graph, log why and run eagerly from then on. A rank
  never replays a graph its peers do not.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from splash.core.ownership import KVPlacement, Layout, get_layout
from splash.core.protocol import WORKER_PROTOCOL_VERSION, StepPlan
from splash.dist.comm import Comm
from splash.dist.host_copy import pinned
from splash.layouts.base import AttentionLayout, StepMeta

logger = logging.getLogger("splash.graphs")

_GHOST = "\x00ghost-"  # request-id prefix of padding rows (never a real id: ids are printable)

Forward = Callable[[torch.Tensor, StepMeta, AttentionLayout], torch.Tensor]
InputIds = Callable[[list[int], StepPlan], torch.Tensor]  # a step's ids on the device


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 to 64, of 16 to 128, of 32 beyond (vLLM-like granularity)."""
    sizes, n = [1, 2, 4], 8
    while n < max_batch:
        sizes.append(n)
        n += 8 if n < 64 else 16 if n < 128 else 32
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


def _bucket(n: int, buckets: list[int]) -> int | None:
    for b in buckets:
        if b >= n:
            return b
    return None


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def graph_width(context: int, page_size: int) -> int:
    """The block-table width of a graph whose longest context is ``context`` tokens: the
    pages it spans, rounded up to a power of two."""
    return _next_pow2(max(-(-context // page_size), 1))


def startup_layouts(fitting: tuple[str, ...] | list[str], initial: str, world: int,
                    resident: bool = False) -> list[str]:
    """The layouts whose graphs a worker can capture at start-up: those whose projection
    placement it holds now (all of them at T = 1, or when every placement is resident)."""
    sharded = get_layout(initial).shards_heads
    return [n for n in fitting
            if world == 1 or resident or get_layout(n).shards_heads == sharded]


def graph_rows(layout: Layout, bucket: int, world: int) -> int:
    """Rows of a padded step at ``bucket``: per rank under owned KV, in all otherwise."""
    return bucket * world if layout.kv is KVPlacement.OWNED else bucket


def startup_graph_keys(layouts: list[str], buckets: list[int], widths: list[int],
                       world: int) -> list[tuple[str, int, int]]:
    """Graph keys (layout, padded rows, table width) to capture at start-up, in capture order
    (the same on every rank): layout by layout, largest batch first, so that the smaller
    graphs reuse the shared pool's blocks."""
    return [(name, graph_rows(get_layout(name), b, world), w) for name in layouts
            for w in widths for b in sorted(buckets, reverse=True)]


def ghost_plan(layout: Layout, rows: int, world: int) -> StepPlan:
    """A decode step of ``rows`` ghost rows (spread evenly over the owners under owned KV):
    what start-up captures run."""
    owned = layout.kv is KVPlacement.OWNED
    owners = [r for r in range(world) for _ in range(rows // world)] if owned else [0] * rows
    n = len(owners)
    return StepPlan(WORKER_PROTOCOL_VERSION, -3, layout.name, [f"{_GHOST}{i}" for i in range(n)],
                    [1] * n, [0] * n, owners, [0] * n, [0] * n, [False] * n, [], [0] * n)


class _Mismatch(Exception):
    """A step's inputs do not have the structure the graph was captured with."""


def _copy_into(static: Any, fresh: Any) -> None:
    """Copy a step's inputs into a graph's static buffers (same nesting, shapes and host values)."""
    if isinstance(static, torch.Tensor):
        if not isinstance(fresh, torch.Tensor) or fresh.shape != static.shape:
            raise _Mismatch(f"tensor {tuple(static.shape)} vs {getattr(fresh, 'shape', fresh)}")
        static.copy_(pinned(fresh, static.device), non_blocking=True)
    elif isinstance(static, dict):
        if not isinstance(fresh, dict) or static.keys() != fresh.keys():
            raise _Mismatch("input keys differ")
        for k in static:
            _copy_into(static[k], fresh[k])
    elif static != fresh:
        raise _Mismatch(f"host value {static!r} vs {fresh!r}")


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor  # (N_pad,) static token ids
    positions: torch.Tensor  # (N_pad,) static positions
    inputs: dict[str, Any]  # the layout's static step tensors
    hidden: torch.Tensor  # (N_pad, hidden) output, valid until the next replay


class DecodeGraphs:
    """Captures and replays decode-step graphs for one worker (see the module docstring)."""

    def __init__(self, forward: Forward, comm: Comm, page_size: int,
                 device: torch.device, max_batch: int = 256, max_graphs: int = 96,
                 capture: bool = True, min_width: int = 1,
                 input_ids: InputIds | None = None) -> None:
        self.forward, self.comm = forward, comm
        # a step's ids on the device (the worker's resolves the draws of the step before)
        self.input_ids = input_ids or (
            lambda ids, plan: torch.tensor(ids, dtype=torch.long, device=device))
        self.rank, self.world = comm.rank, comm.world
        if capture:
            comm.make_graph_group(device)
        self.page_size, self.device = page_size, device
        self.buckets = batch_buckets(max_batch)
        self.max_graphs, self.capture = max_graphs, capture
        self.min_width = min_width
        self.pool: Any = None
        # one side stream for every capture's warm-up: the allocator caches a stream's freed
        # blocks for that stream alone, so a new stream per capture kept a step's activations
        # (and a cuBLAS workspace) cached for each graph
        self.warm_stream: Any = None
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.disabled = False
        self.replays = 0

    # -- padding ---------------------------------------------------------------------------
    def pad(self, plan: StepPlan, impl: AttentionLayout) -> StepPlan | None:
        """The plan with ghost requests appended up to the batch bucket (per owner for
        owner-held layouts); None when the step is not graph-eligible."""
        if self.disabled or (plan.switch is not None and plan.switch.hooks_forward) or \
                not plan.query_lens:
            return None
        if any(n != 1 for n in plan.query_lens):
            return None
        n = len(plan.request_ids)
        if impl.layout.kv is KVPlacement.OWNED:
            counts = [0] * self.world
            for owner in plan.owners:
                counts[owner] += 1
            per_rank = _bucket(max(counts), self.buckets)
            if per_rank is None:
                return None
            ghost_owners = [r for r in range(self.world) for _ in range(per_rank - counts[r])]
        else:
            padded = _bucket(n, self.buckets)
            if padded is None:
                return None
            ghost_owners = [0] * (padded - n)
        g = len(ghost_owners)
        if g == 0:
            return plan
        return msgspec.structs.replace(
            plan,
            request_ids=plan.request_ids + [f"{_GHOST}{i}" for i in range(g)],
            query_lens=plan.query_lens + [1] * g,
            context_lens=plan.context_lens + [0] * g,
            owners=plan.owners + ghost_owners,
            input_ids=plan.input_ids + [0] * g,
            positions=plan.positions + [0] * g,
            sample=plan.sample + [False] * g,
            sampling=plan.sampling + [plan.sampling[0]] * g if plan.sampling else [],
            output_index=plan.output_index + [0] * g,
        )

    def key(self, plan: StepPlan, padded: StepPlan, impl: AttentionLayout) -> tuple[str, int, int]:
        """(layout, padded rows, table width) of a step: the width from the plan's longest
        context, never below ``min_width`` (the start-up width, so that every shorter context
        replays a start-up graph)."""
        width = max(graph_width(max(plan.context_lens), self.page_size), self.min_width)
        return impl.layout.name, len(padded.request_ids), width

    # -- run -------------------------------------------------------------------------------
    def run(self, plan: StepPlan, tables: dict[str, list[int]],
            impl: AttentionLayout) -> torch.Tensor | None:
        """Hidden states (N, hidden) of the step's rows from a graph replay, or None when the
        step must run eagerly."""
        padded = self.pad(plan, impl)
        if padded is None:
            return None
        # from the plan, not this rank's tables, so every rank picks the same key (a rank that
        # captured while another replayed would run its collectives a different number of times)
        key = self.key(plan, padded, impl)
        width = key[2]
        entry = self.graphs.get(key) if self.capture else None
        # a replay builds the step's inputs on the host and copies them straight into the
        # graph's buffers; eager runs and captures build them on the device
        meta = StepMeta(padded, tables, self.rank, self.world, self.page_size,
                        torch.device("cpu") if entry is not None else self.device,
                        table_width=width)
        if not self.capture:
            ids = self.input_ids(padded.input_ids, padded)
            return self.forward(ids, meta, impl)[: len(plan.request_ids)]
        if entry is None:
            entry = self._capture(key, padded, meta, impl)
            if entry is None:
                return None
        else:
            self.graphs.move_to_end(key)
            try:
                _copy_into(entry.inputs, impl.inputs(meta))
            except _Mismatch as e:  # never expected: same key, same structure
                logger.warning("graph %s: inputs changed structure (%s); running eagerly", key, e)
                return None
            entry.positions.copy_(pinned(meta.positions, self.device), non_blocking=True)
            entry.ids.copy_(self.input_ids(padded.input_ids, padded), non_blocking=True)
        entry.graph.replay()
        self.replays += 1
        logger.debug("rank %d: step %d replayed graph %s", self.rank, plan.step, key)
        return entry.hidden[: len(plan.request_ids)]

    def capture_keys(self, keys: list[tuple[str, int, int]],
                     impls: dict[str, AttentionLayout]) -> int:
        """Capture ``keys`` (`startup_graph_keys`) from ghost steps; the number held after."""
        self.max_graphs = max(self.max_graphs, len(keys) + len(self.graphs))
        for key in keys:
            if self.disabled:
                break
            if key in self.graphs:
                continue
            name, rows, width = key
            plan = ghost_plan(impls[name].layout, rows, self.world)
            meta = StepMeta(plan, {}, self.rank, self.world, self.page_size, self.device,
                            table_width=width)
            self._capture(key, plan, meta, impls[name], log=False)
        return len(self.graphs)

    def _capture(self, key: tuple, padded: StepPlan, meta: StepMeta,
                 impl: AttentionLayout, log: bool = True) -> _Graph | None:
        t0 = time.perf_counter()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
            self.warm_stream = torch.cuda.Stream(self.device)
        ids = self.input_ids(padded.input_ids, padded)
        inputs = meta.inputs(impl)  # the static buffers from now on
        graph, hidden, error = torch.cuda.CUDAGraph(), None, ""
        with self.comm.capturing():
            # warm-up on a side stream: compiles kernels, connects the capture group's peers,
            # idempotent KV writes. A failure here is a failure of the step itself.
            stream = self.warm_stream
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self.forward(ids, meta, impl)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            try:  # nothing executes while capturing, so a failed rank blocks no peer
                with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                    hidden = self.forward(ids, meta, impl)
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
        if not self.comm.all_agree(not error, self.device):
            logger.warning("CUDA graph capture failed for %s (%s); decode steps run eagerly "
                           "from now on", key, error or "on another rank")
            self.disabled = True
            self.graphs.clear()
            return None
        assert hidden is not None
        entry = _Graph(graph, ids, meta.positions, inputs, hidden)
        self.graphs[key] = entry
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        logger.log(logging.INFO if log else logging.DEBUG,
                   "captured CUDA graph: layout %s, batch %d, block-table width %d (%.0f ms, "
                   "%d graphs held)", key[0], key[1], key[2], (time.perf_counter() - t0) * 1e3,
                   len(self.graphs))
        return entry
