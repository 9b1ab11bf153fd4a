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
placed tensors flattened. Rows are packed with the Triton
exchange kernels into one contiguous buffer per layer group (the controller sizes groups to
about 1 GiB per message, where a collective reaches the link), so a switch issues a few large
collectives instead of one per layer and kind. Every rank enters every collective, with or
without rows of its own; the plan says which collectives a switch has.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any

import torch

from splash.core.protocol import SwitchPlan
from splash.dist.comm import Comm
from splash.kernels_triton import gather_rows, scatter_rows
from splash.layouts.base import KVStore

_PLACED = ("q_b", "w_uk", "w_uv", "w_o")


def _byte_rows(t: torch.Tensor) -> torch.Tensor:
    """(P, PS, D) or (P, PS) pool as (P*PS, words per row), sharing storage: raw bits in the
    widest integer type that divides a row (a 1,152-byte latent row is 144 int64 words, so the
    exchange kernels move 8 bytes per element instead of one)."""
    rows = t.reshape(t.shape[0] * t.shape[1], -1).view(torch.uint8)
    for word in (torch.int64, torch.int32, torch.int16):
        if rows.shape[1] % word.itemsize == 0 and rows.data_ptr() % word.itemsize == 0:
            return rows.view(word)
    return rows


def slots_from_runs(runs: list[list[int]], device: torch.device) -> torch.Tensor:
    """Flat ``[slot, n, ...]`` runs per peer -> the slot of every row, peers in order."""
    flat = [x for r in runs for x in r]
    if not flat:
        return torch.empty(0, dtype=torch.long, device=device)
    t = torch.tensor(flat, dtype=torch.long).view(-1, 2)
    starts, counts = t[:, 0], t[:, 1]
    first = torch.cumsum(counts, 0) - counts  # row index where each run begins
    slots = torch.repeat_interleave(starts - first, counts) + torch.arange(int(counts.sum()))
    return slots.to(device)


def _flat_heads(attn: Any) -> torch.Tensor:
    placed = attn.placed_weights()
    return torch.cat([placed[k].reshape(placed[k].shape[0], -1) for k in _PLACED], dim=1)


def install_heads(attn: Any, plan: SwitchPlan, received: torch.Tensor,
                  received_heads: list[int]) -> None:
    """Assemble the destination head range from kept local heads and received rows."""
    mv = plan.weights
    old = range(attn.head_start, attn.head_start + attn.num_heads)
    if old.start == mv.head_start and old.stop == mv.head_stop:
        return
    placed = attn.placed_weights()
    flat = _flat_heads(attn)
    recv_pos = {h: i for i, h in enumerate(received_heads)}
    rows = [flat[h - old.start] if h in old else received[recv_pos[h]]
            for h in range(mv.head_start, mv.head_stop)]
    new_flat = torch.stack(rows)  # (h_new, E)
    tensors, col = {}, 0
    for k in _PLACED:
        shape = placed[k].shape[1:]
        width = int(torch.Size(shape).numel())
        tensors[k] = new_flat[:, col: col + width].reshape(len(rows), *shape).contiguous()
        col += width
    attn.set_placed(mv.head_start, tensors)


class _Moves:
    """One plan's row and head indices, resolved on the device once."""

    def __init__(self, plan: SwitchPlan, device: torch.device) -> None:
        kv, w = plan.kv, plan.weights
        self.send_counts = [sum(r[1::2]) for r in kv.send_runs]
        self.recv_counts = [sum(r[1::2]) for r in kv.recv_runs]
        self.send_slots = slots_from_runs(kv.send_runs, device)
        self.recv_slots = slots_from_runs(kv.recv_runs, device)
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

    def issue(self, layers: list[int]) -> _Group:
        m, group, g = self.moves, self.comm.xfer_group, _Group(layers)
        if self.plan.kv_moves:  # every rank enters, with or without rows of its own
            pools = [p for layer in layers for p in self.store.slot_pools(layer)]
            # each pool gathered in its widest word, then side by side as bytes
            send = torch.cat([gather_rows(_byte_rows(p), m.send_slots).view(torch.uint8)
                              for p in pools], dim=1)
            g.kv, work = self.comm.all_to_all_rows(send, m.send_counts, m.recv_counts,
                                                   group=group, async_op=True)
            g.works.append(work)
        if self.move_weights and self.plan.heads_move:
            parts = []
            for layer in layers:
                attn = self.attns[layer]
                idx = torch.tensor([h - attn.head_start for h in m.sent_heads], dtype=torch.long,
                                   device=self.device)
                parts.append(gather_rows(_flat_heads(attn), idx))
            g.heads, work = self.comm.all_to_all_rows(
                torch.cat(parts, dim=1), m.w_send_counts, m.w_recv_counts, group=group,
                async_op=True)
            g.works.append(work)
        return g

    def unpack(self, g: _Group) -> dict[int, torch.Tensor]:
        """Scatter a completed group's KV rows into the pools; its heads per layer."""
        m = self.moves
        heads: dict[int, torch.Tensor] = {}
        col = 0  # byte column of the group's rows: every pool of every layer, side by side
        for j, layer in enumerate(g.layers):
            for pool in self.store.slot_pools(layer):
                rows = _byte_rows(pool)
                width = rows.shape[1] * rows.element_size()
                if g.kv is not None and m.recv_slots.numel():
                    part = g.kv[:, col:col + width].contiguous().view(rows.dtype)
                    scatter_rows(rows, m.recv_slots, part)
                col += width
            if g.heads is not None:
                width = g.heads.shape[1] // len(g.layers)
                heads[layer] = g.heads[:, j * width:(j + 1) * width]
        if g.kv is not None:
            self.kv_bytes += g.kv.numel() * g.kv.element_size()
        if g.heads is not None:
            self.weight_bytes += g.heads.numel() * g.heads.element_size()
        return heads


class PreCopy:
    """A background transfer: issued now, completed at the handoff (or dropped on cancel)."""

    def __init__(self, plan: SwitchPlan, comm: Comm, store: KVStore, attns: list[Any],
                 device: torch.device) -> None:
        self.xfer = _Transfer(plan, comm, store, attns, device)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
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
        self.busy_ms = 0.0  # all switch work: packing, issuing, waiting, installing

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
        if self.staged is not None:
            self.heads, _ = self.staged.complete()
        for layers in self.xfer.groups(per_layer=False):
            g = self.xfer.issue(layers)
            g.wait()
            self.heads.update(self.xfer.unpack(g))
        self._install(range(len(self.attns)))
        self.wait_ms = self.busy_ms = (time.perf_counter() - t0) * 1e3

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
