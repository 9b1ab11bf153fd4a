"""Worker side of a switch: move the destination's missing state over the transfer group.

Three ways, all on the transfer process group (its own NCCL communicator, hence its own stream,
on GPU; gloo's background threads on CPU):

- **Background** (``PreCopy``): the whole transfer is issued when a ``precopy`` plan arrives and
  runs while the step, and the steps after it, still compute in the source layout; it packs on
  a stream of its own. The ``handoff`` plan completes it (unpacks the rows into the destination
  pages and installs the received projection heads), then moves the delta (rows written since)
  and the step computes in the destination.
- **Live** (``SwitchExecutor``, layer-pipelined): before layer l computes, layer l+1's transfer
  is issued, then layer l waits for its own only; the step computes in the destination.
- **Blocking**: everything moves first (the baseline for measurement).

KV rows move as raw bytes: a row is every per-slot pool of the layer side by side — the latent
row, its fp8 scale, and in DSA models the indexer key and its scale (same slot, same page) — so
everything moves exactly, with no requantisation. Projection heads move as rows of the four
placed tensors flattened. Rows are packed (``packing.py``) with the Triton exchange kernels
into one contiguous buffer per layer group (the controller sizes groups to
about 1 GiB per message, where a collective reaches the link), so a switch issues a few large
collectives instead of one per layer and kind. Every rank enters every collective, with or
without rows of its own; the plan says which collectives a switch has.
"""

from __future__ import annotations

import functools
import time
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch
from torch.profiler import record_function

from splash.core.protocol import SwitchPlan
from splash.dist.comm import Comm
from splash.dist.host_copy import to_device
from splash.kernels_triton import expand_runs, gather_rows, scatter_rows
from splash.layouts.base import KVStore
from splash.switching.packing import pack, row_layout, unpack

_PLACED = ("q_b", "w_uk", "w_uv", "w_o")


def _pairs(runs: list[list[int]]) -> list[np.ndarray]:
    """Each peer's flat ``[slot, n, ...]`` runs as a (runs, 2) array."""
    return [np.asarray(r, dtype=np.int64).reshape(-1, 2) for r in runs]


def slots_from_runs(runs: list[list[int]], device: torch.device) -> torch.Tensor:
    """Flat ``[slot, n, ...]`` runs per peer -> the slot of every row, peers in order."""
    return _slots(_pairs(runs), device)


def _slots(per_peer: list[np.ndarray], device: torch.device) -> torch.Tensor:
    """Only the runs cross to the device (one copy that never waits for it); one kernel
    writes the rows there (a 32K-token context is 512 runs but 32,768 rows)."""
    pairs = np.concatenate(per_peer) if per_peer else np.zeros((0, 2), np.int64)
    counts = pairs[:, 1]
    total = int(counts.sum())
    if not total:
        return torch.empty(0, dtype=torch.long, device=device)
    first = np.cumsum(counts) - counts  # row index where each run begins
    table = np.ascontiguousarray(np.stack([pairs[:, 0], first, counts], axis=1), np.int64)
    return expand_runs(to_device(torch.from_numpy(table), device), total, int(counts.max()))


def _head_rows(attn: Any) -> list[torch.Tensor]:
    """The four placed tensors of a layer as (heads, elements) rows (views)."""
    placed = attn.placed_weights()
    return [placed[k].reshape(placed[k].shape[0], -1) for k in _PLACED]


def install_heads(attn: Any, plan: SwitchPlan, received: torch.Tensor,
                  received_heads: list[int]) -> None:
    """Assemble the destination head range from kept local heads (one slice copy) and received
    rows (scattered into place), tensor by tensor."""
    mv = plan.weights
    old = range(attn.head_start, attn.head_start + attn.num_heads)
    new = range(mv.head_start, mv.head_stop)
    if old == new:
        return
    if not received_heads and attn.holds(new):  # resident (or kept for CUDA graphs)
        attn.use(new)
        return
    lo, hi = max(old.start, new.start), min(old.stop, new.stop)
    dst = to_device(torch.tensor([h - new.start for h in received_heads], dtype=torch.long),
                    received.device)
    if len(received_heads) + max(hi - lo, 0) != len(new):
        raise RuntimeError(f"heads {list(new)} are neither kept nor received "
                           f"(kept {lo}..{hi}, received {received_heads})")
    placed = attn.placed_weights()
    tensors, col = {}, 0
    for k in _PLACED:
        src = placed[k]
        t = src.new_empty((len(new), *src.shape[1:]))
        if hi > lo:
            t[lo - new.start: hi - new.start].copy_(src[lo - old.start: hi - old.start])
        width = t[0].numel()
        if received_heads:
            scatter_rows(t.view(len(new), -1), dst, received[:, col:col + width])
        tensors[k] = t
        col += width
    attn.set_placed(mv.head_start, tensors)


class _Moves:
    """One plan's row and head indices, resolved on the device once."""

    def __init__(self, plan: SwitchPlan, device: torch.device) -> None:
        kv, w = plan.kv, plan.weights
        send, recv = _pairs(kv.send_runs), _pairs(kv.recv_runs)
        self.send_counts = [int(p[:, 1].sum()) for p in send]
        self.recv_counts = [int(p[:, 1].sum()) for p in recv]
        self.send_slots = _slots(send, device)
        self.recv_slots = _slots(recv, device)
        self.w_send_counts = [len(s) for s in w.send_to]
        self.w_recv_counts = [len(s) for s in w.recv_from]
        self.sent_heads = [h for s in w.send_to for h in s]
        self.received_heads = [h for s in w.recv_from for h in s]


class _Group:
    """In-flight collectives of one layer group: received buffers and work handles."""

    def __init__(self, layers: list[int]) -> None:
        self.layers = layers
        self.kv: torch.Tensor | None = None
        self.heads: torch.Tensor | None = None
        self.works: list[Any] = []

    def done(self) -> bool:
        return all(w is None or w.is_completed() for w in self.works)

    def wait(self) -> None:
        for w in self.works:
            if w is not None:
                w.wait()
        self.works = []


class _Transfer:
    """Packs, issues and unpacks one plan's moves, a layer group per collective."""

    def __init__(self, plan: SwitchPlan, comm: Comm, store: KVStore, attns: list[Any],
                 device: torch.device, move_weights: bool = True) -> None:
        self.plan, self.comm, self.store, self.attns = plan, comm, store, attns
        self.device = device
        self.moves = _Moves(plan, device)
        self.move_weights = move_weights
        self.kv_bytes = 0
        self.weight_bytes = 0

    def groups(self, per_layer: bool) -> list[list[int]]:
        """Layers per collective: one each (live), else the plan's group size (the same on
        every rank: the controller sizes groups from the busiest rank's bytes)."""
        layers = list(range(len(self.attns)))
        size = 1 if per_layer else max(self.plan.layers_per_group, 1)
        return [layers[i: i + size] for i in range(0, len(layers), size)]

    def pack_kv(self, layers: list[int]) -> torch.Tensor:
        """The rows this rank sends for ``layers``: every slot pool of every layer side by side
        (byte columns), one row per sent slot, peers in order."""
        m = self.moves
        layout, width = row_layout(self.store.slot_kinds(layers))
        send = torch.empty((len(m.send_slots), width), dtype=torch.uint8, device=self.device)
        if m.send_slots.numel():
            for block in layout:
                pack(block, m.send_slots, send)
        return send

    def pack_heads(self, layers: list[int]) -> torch.Tensor:
        """The projection heads this rank sends for ``layers``: one row per sent head, the four
        placed tensors of every layer side by side."""
        m = self.moves
        parts = {i: _head_rows(self.attns[i]) for i in layers}
        send = parts[layers[0]][0].new_empty(
            (len(m.sent_heads), sum(t.shape[1] for ts in parts.values() for t in ts)))
        col, index = 0, {}
        for i in layers:
            start = self.attns[i].head_start
            if start not in index:  # one host-to-device copy for every layer alike
                index[start] = to_device(torch.tensor([h - start for h in m.sent_heads],
                                                      dtype=torch.long), self.device)
            idx = index[start]
            for t in parts[i]:
                gather_rows(t, idx, out=send[:, col:col + t.shape[1]])
                col += t.shape[1]
        return send

    def issue(self, layers: list[int]) -> _Group:
        """Pack ``layers`` and start their collectives (every rank enters, rows or not)."""
        m, group, g = self.moves, self.comm.xfer_group, _Group(layers)
        if self.plan.kv_moves:
            g.kv, work = self.comm.all_to_all_rows(self.pack_kv(layers), m.send_counts,
                                                   m.recv_counts, group=group, async_op=True)
            g.works.append(work)
        if self.move_weights and self.plan.heads_move:
            g.heads, work = self.comm.all_to_all_rows(
                self.pack_heads(layers), m.w_send_counts, m.w_recv_counts, group=group,
                async_op=True)
            g.works.append(work)
        return g

    def unpack(self, g: _Group) -> dict[int, torch.Tensor]:
        """Scatter a completed group's KV rows into the pools; its heads per layer."""
        m = self.moves
        heads: dict[int, torch.Tensor] = {}
        if g.kv is not None:
            layout = row_layout(self.store.slot_kinds(g.layers))[0]
            if m.recv_slots.numel():
                for block in layout:
                    unpack(block, m.recv_slots, g.kv)
            # payload, no padding
            self.kv_bytes += g.kv.shape[0] * sum(b.width * b.rows.shape[0] for b in layout)
        if g.heads is not None:
            width = g.heads.shape[1] // len(g.layers)
            for j, layer in enumerate(g.layers):
                heads[layer] = g.heads[:, j * width:(j + 1) * width]
            self.weight_bytes += g.heads.numel() * g.heads.element_size()
        return heads


@functools.cache
def _pack_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream every background transfer on ``device`` packs on. One for the process:
    the allocator keeps a stream's freed blocks for that stream alone, so a new stream per
    switch would leave each switch's pack buffers (up to a message, about 1 GiB) cached where
    no later allocation reuses them."""
    return torch.cuda.Stream(device)


class PreCopy:
    """A background transfer: issued now, completed at the handoff (or dropped on cancel)."""

    def __init__(self, plan: SwitchPlan, comm: Comm, store: KVStore, attns: list[Any],
                 device: torch.device) -> None:
        self.xfer = _Transfer(plan, comm, store, attns, device)
        self.stream = _pack_stream(device) if device.type == "cuda" else None
        if self.stream is not None:  # pack beside the step's compute, after what came before
            self.stream.wait_stream(torch.cuda.current_stream(device))
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()
        with ctx:
            self.groups = [self.xfer.issue(layers) for layers in self.xfer.groups(per_layer=False)]

    def done(self) -> bool:
        return all(g.done() for g in self.groups)

    def complete(self) -> tuple[dict[int, torch.Tensor], float]:
        """Wait, unpack every row into its destination page; (heads per layer, wait ms)."""
        t0 = time.perf_counter()
        heads: dict[int, torch.Tensor] = {}
        for g in self.groups:
            g.wait()
        wait_ms = (time.perf_counter() - t0) * 1e3
        if self.stream is not None:
            torch.cuda.current_stream(self.xfer.device).wait_stream(self.stream)
        for g in self.groups:
            heads.update(self.xfer.unpack(g))
        self.groups = []
        return heads, wait_ms

    def cancel(self) -> None:
        for g in self.groups:  # collectives must complete on every rank before anything else
            g.wait()
        self.groups = []


class SwitchExecutor:
    """A switch completed within one step: ``live`` (layer-pipelined), ``blocking``, or the
    ``handoff`` of a pre-copy (``staged``; only the delta moves here, heads came with it)."""

    def __init__(self, plan: SwitchPlan, comm: Comm, store: KVStore, attns: list[Any],
                 device: torch.device, staged: PreCopy | None = None) -> None:
        self.plan, self.attns, self.device = plan, attns, device
        self.xfer = _Transfer(plan, comm, store, attns, device, move_weights=staged is None)
        self.staged = staged
        self.heads_from = (staged.xfer if staged is not None else self.xfer).moves
        self.pending: dict[int, _Group] = {}
        self.heads: dict[int, torch.Tensor] = {}
        self.wait_ms = 0.0  # waiting for transfers
        self.busy_ms = 0.0  # all switch work: packing, issuing, waiting, installing (host)
        # device time of the transfer on the step's stream (blocking and handoff: everything
        # moves before the forward), read once the step is done
        self._events: tuple[Any, Any] | None = None

    @property
    def kv_bytes(self) -> int:
        return self.xfer.kv_bytes + (self.staged.xfer.kv_bytes if self.staged else 0)

    @property
    def weight_bytes(self) -> int:
        return self.xfer.weight_bytes + (self.staged.xfer.weight_bytes if self.staged else 0)

    def start(self) -> None:
        t0 = time.perf_counter()
        if self.plan.mode == "live":
            self.pending[0] = self.xfer.issue([0])
            self.busy_ms += (time.perf_counter() - t0) * 1e3
            return
        if self.device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True),
                            torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        if self.staged is not None:
            self.heads, _ = self.staged.complete()
        # two groups in flight: the next group packs while this one's collective runs, and
        # this one unpacks while the next one's runs
        last: _Group | None = None
        with record_function("switch transfer"):
            for layers in self.xfer.groups(per_layer=False):
                g = self.xfer.issue(layers)
                if last is not None:
                    last.wait()
                    self.heads.update(self.xfer.unpack(last))
                last = g
            if last is not None:
                last.wait()
                self.heads.update(self.xfer.unpack(last))
        with record_function("switch install"):
            self._install(range(len(self.attns)))
        if self._events is not None:
            self._events[1].record()
        self.wait_ms = self.busy_ms = (time.perf_counter() - t0) * 1e3

    def device_ms(self) -> float | None:
        """Device time from the transfer's first pack to its last unpack, on the step's
        stream (after the step is done); None where no events time it (live, CPU)."""
        return None if self._events is None else self._events[0].elapsed_time(self._events[1])

    def before_layer(self, layer: int) -> None:
        if self.plan.mode != "live":
            return
        t0 = time.perf_counter()
        if layer + 1 < len(self.attns):
            self.pending[layer + 1] = self.xfer.issue([layer + 1])
        t1 = time.perf_counter()
        g = self.pending.pop(layer)
        g.wait()
        self.wait_ms += (time.perf_counter() - t1) * 1e3
        self.heads.update(self.xfer.unpack(g))
        self._install([layer])
        self.busy_ms += (time.perf_counter() - t0) * 1e3

    def _install(self, layers) -> None:
        empty = torch.empty(0, device=self.device)
        for layer in layers:
            install_heads(self.attns[layer], self.plan, self.heads.pop(layer, empty),
                          self.heads_from.received_heads)
