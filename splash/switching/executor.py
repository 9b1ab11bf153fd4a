"""Worker side of a live switch: move each layer's missing state while the step
computes in the destination layout.

Layer-pipelined: before layer l computes, layer l+1's transfer is issued on the transfer process
group (its own NCCL communicator and stream on GPU; gloo's background thread on CPU — the
transfer is issued before the compute it overlaps), then layer l waits for its own transfer
only. Blocking mode issues and waits for every layer first: the baseline for measurement.

Per layer, one uneven all-to-all carries KV rows (as raw bytes: latent, rope keys and fp8
scales move exactly, no requantisation) and one carries projection heads (the four placed
tensors of a head flattened into one row). Rows are packed and unpacked with the Triton
exchange kernels.
"""

from __future__ import annotations

import time

import torch

from splash.core.protocol import SwitchPlan
from splash.dist.comm import Comm
from splash.kernels_triton import gather_rows, scatter_rows
from splash.layouts.base import KVStore
from splash.model.attention import MLAAttention

_PLACED = ("q_b", "w_uk", "w_uv", "w_o")


def _byte_rows(t: torch.Tensor) -> torch.Tensor:
    """(P, PS, D) or (P, PS) pool as (P*PS, bytes per row) uint8, sharing storage."""
    rows = t.reshape(t.shape[0] * t.shape[1], -1)
    return rows.view(torch.uint8)


class LayerTransfer:
    def __init__(self, kv_recv, kv_work, w_recv, w_work, scale_recv, scale_work) -> None:
        self.kv_recv, self.kv_work = kv_recv, kv_work
        self.w_recv, self.w_work = w_recv, w_work
        self.scale_recv, self.scale_work = scale_recv, scale_work


class SwitchExecutor:
    def __init__(self, plan: SwitchPlan, comm: Comm, store: KVStore, attns: list[MLAAttention],
                 device: torch.device) -> None:
        self.plan, self.comm, self.store, self.attns = plan, comm, store, attns
        self.device = device
        self.num_layers = len(attns)
        self.pending: dict[int, LayerTransfer] = {}
        self.busy_ms = 0.0  # all switch work in the step: issue, wait, install
        self.kv_bytes = 0
        self.weight_bytes = 0
        kv = plan.kv
        self.send_counts = [len(s) for s in kv.send_slots]
        self.recv_counts = [len(s) for s in kv.recv_slots]
        self.send_slots = self._index([x for s in kv.send_slots for x in s])
        self.recv_slots = self._index([x for s in kv.recv_slots for x in s])
        w = plan.weights
        self.w_send_counts = [len(s) for s in w.send_to]
        self.w_recv_counts = [len(s) for s in w.recv_from]
        self.received_heads = [h for s in w.recv_from for h in s]

    def _index(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    # -- per layer ------------------------------------------------------------------------
    def _issue(self, layer: int) -> None:
        t0 = time.perf_counter()
        group = self.comm.xfer_group
        cache, scale = self.store.layer(layer)
        kv_send = gather_rows(_byte_rows(cache), self.send_slots)  # (M, row bytes)
        kv_recv, kv_work = self.comm.all_to_all_rows(
            kv_send, self.send_counts, self.recv_counts, group=group, async_op=True)
        scale_recv = scale_work = None
        if scale is not None:
            s_send = gather_rows(_byte_rows(scale), self.send_slots)
            scale_recv, scale_work = self.comm.all_to_all_rows(
                s_send, self.send_counts, self.recv_counts, group=group, async_op=True)
        attn = self.attns[layer]
        flat = self._flat_heads(attn)  # (h_old, E)
        w_idx = self._index([h - attn.head_start for s in self.plan.weights.send_to for h in s])
        w_send = gather_rows(flat, w_idx)
        w_recv, w_work = self.comm.all_to_all_rows(
            w_send, self.w_send_counts, self.w_recv_counts, group=group, async_op=True)
        self.pending[layer] = LayerTransfer(kv_recv, kv_work, w_recv, w_work,
                                            scale_recv, scale_work)
        self.busy_ms += (time.perf_counter() - t0) * 1e3

    def _complete(self, layer: int) -> None:
        t0 = time.perf_counter()
        xfer = self.pending.pop(layer)
        for work in (xfer.kv_work, xfer.scale_work, xfer.w_work):
            if work is not None:
                work.wait()
        cache, scale = self.store.layer(layer)
        if self.recv_slots.numel():
            scatter_rows(_byte_rows(cache), self.recv_slots, xfer.kv_recv)
            if scale is not None:
                scatter_rows(_byte_rows(scale), self.recv_slots, xfer.scale_recv)
        self.kv_bytes += xfer.kv_recv.numel() * xfer.kv_recv.element_size()
        if xfer.scale_recv is not None:
            self.kv_bytes += xfer.scale_recv.numel() * xfer.scale_recv.element_size()
        self.weight_bytes += xfer.w_recv.numel() * xfer.w_recv.element_size()
        self._install_heads(self.attns[layer], xfer.w_recv)
        self.busy_ms += (time.perf_counter() - t0) * 1e3

    def _flat_heads(self, attn: MLAAttention) -> torch.Tensor:
        placed = attn.placed_weights()
        return torch.cat([placed[k].reshape(placed[k].shape[0], -1) for k in _PLACED], dim=1)

    def _install_heads(self, attn: MLAAttention, received: torch.Tensor) -> None:
        """Assemble the destination head range from kept local heads and received ones."""
        mv = self.plan.weights
        old = range(attn.head_start, attn.head_start + attn.num_heads)
        if old.start == mv.head_start and old.stop == mv.head_stop:
            return
        placed = attn.placed_weights()
        flat = self._flat_heads(attn)
        rows = []
        recv_pos = {h: i for i, h in enumerate(self.received_heads)}
        for h in range(mv.head_start, mv.head_stop):
            rows.append(flat[h - old.start] if h in old else received[recv_pos[h]])
        new_flat = torch.stack(rows)  # (h_new, E)
        tensors, col = {}, 0
        for k in _PLACED:
            shape = placed[k].shape[1:]
            width = int(torch.Size(shape).numel())
            tensors[k] = new_flat[:, col: col + width].reshape(len(rows), *shape).contiguous()
            col += width
        attn.set_placed(mv.head_start, tensors)

    # -- hooks used by the worker's forward ------------------------------------------------
    def start(self) -> None:
        if self.plan.blocking:
            for layer in range(self.num_layers):
                self._issue(layer)
            for layer in range(self.num_layers):
                self._complete(layer)
        else:
            self._issue(0)

    def before_layer(self, layer: int) -> None:
        if self.plan.blocking:
            return
        if layer + 1 < self.num_layers:
            self._issue(layer + 1)
        self._complete(layer)
