"""Collectives a worker uses, over torch.distributed (nccl / rccl / gloo).

Process groups: ``group`` for the eager forward (all-reduce, all-gather, all-to-all) and
``xfer_group`` for switch transfers, so a layer's transfer can run while another layer's
forward collectives proceed (a separate NCCL communicator is a separate stream). A worker that
replays CUDA graphs adds a third, used only while capturing (``graph_group()``, then
``capturing()``): collectives baked into graphs then run on a communicator that eager code
never touches, as the serving engines that capture NCCL do.
With world == 1 every collective is the identity and torch.distributed is never touched.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from splash import envs
from splash.logging_utils import get_logger

logger = get_logger("splash.dist")

# torch >= 2.13 names it all_gather_single; older releases all_gather_into_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Comm:
    def __init__(self, rank: int, world: int, use_dist: bool = True) -> None:
        self.rank, self.world = rank, world
        self.group = None
        self.xfer_group = None
        if world > 1 and use_dist:
            self.group = dist.group.WORLD
            self.xfer_group = dist.new_group(list(range(world)))
        self._graph_group = None
        self._fast: tuple[torch.Tensor, str] | None = None  # `enable_fast_sum`'s buffer, group

    @property
    def stream_ordered(self) -> bool:
        """Whether a waited collective orders the caller's stream after it (NCCL, RCCL): an
        event recorded after it covers it. gloo moves device tensors through host copies of
        its own."""
        return self.group is None or dist.get_backend(self.group) == "nccl"

    def make_graph_group(self, device: torch.device) -> None:
        """Create the capture-only group and connect it (collective: every rank calls it at the
        same point)."""
        if self.group is not None and self._graph_group is None:
            self._graph_group = dist.new_group(list(range(self.world)))
            self._connect(self._graph_group, device)

    def connect(self, device: torch.device) -> None:
        """Connect the peers of the forward and transfer groups now (collective). NCCL builds a
        group's rings and peer-to-peer channels on its first collectives (a first large
        all-to-all took 80-90 ms inside a switch on 2 x H200 where later ones took 2 ms),
        which would otherwise land in a user's step or a switch."""
        for group in (self.group, self.xfer_group):
            if group is not None:
                self._connect(group, device)

    def _connect(self, group, device: torch.device, peer_bytes: int = 16 << 20) -> None:
        """A small and (on GPUs) a large message of each kind the group carries."""
        sizes = [self.world] + ([self.world * (peer_bytes // 4)] if device.type != "cpu" else [])
        for n in sizes:
            t = torch.zeros(n, device=device)
            dist.all_reduce(t[: self.world], group=group)
            dist.all_to_all_single(torch.empty_like(t), t, group=group)
            _all_gather(torch.empty(self.world * n, device=device), t, group=group)

    @contextmanager
    def capturing(self) -> Iterator[None]:
        """Forward collectives go to the capture-only group inside this block."""
        saved = self.group
        if self._graph_group is not None:
            self.group = self._graph_group
        try:
            yield
        finally:
            self.group = saved

    def all_agree(self, ok: bool, device: torch.device) -> bool:
        """True on every rank iff ``ok`` is true on every rank (an eager MIN all-reduce)."""
        if self.world == 1:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks in place (and return it)."""
        if self.world > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def sum_partials(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of their partials ``t`` (a layer's output shares): a new
        tensor from the one-shot all-reduce on symmetric memory when it is on and ``t`` fits
        its buffer, else ``t`` summed in place over the group."""
        fast = self._fast
        if fast is not None and t.dtype == fast[0].dtype and t.numel() <= fast[0].numel() \
                and t.is_contiguous():
            buf = fast[0][: t.numel()].view(t.shape)
            return torch.ops.symm_mem.one_shot_all_reduce_copy(buf, t, "sum", fast[1])
        return self.all_reduce(t)

    def enable_fast_sum(self, device: torch.device, dtype: torch.dtype,
                        max_bytes: int = 2 << 20) -> bool:
        """``sum_partials`` of tensors up to ``max_bytes`` through a one-shot all-reduce on
        symmetric memory (each rank reads its peers' partials over NVLink in one kernel; no
        NCCL launch, no ring) when ``SPLASH_FAST_ALLREDUCE=1``, on NVIDIA GPUs. Collective;
        every rank ends with the same choice (a failed set-up anywhere keeps NCCL)."""
        self._fast = None
        if self.world == 1 or self.group is None or device.type != "cuda" \
                or torch.version.hip is not None or envs.get("SPLASH_FAST_ALLREDUCE") != "1":
            return False
        ok, state, error = True, None, ""
        try:
            import torch.distributed._symmetric_memory as symm_mem

            name = self.group.group_name
            buf = symm_mem.empty(max_bytes // dtype.itemsize, dtype=dtype, device=device)
            symm_mem.rendezvous(buf, name)
            probe = torch.ones(8, dtype=dtype, device=device)
            got = torch.ops.symm_mem.one_shot_all_reduce_copy(buf[:8], probe, "sum", name)
            ok = bool((got == self.world).all())
            state = (buf, name)
        except Exception as e:  # noqa: BLE001 - an optional fast path: NCCL stays
            ok, error = False, f"{type(e).__name__}: {e}"
        if not self.all_agree(ok, device):
            logger.warning("one-shot all-reduce on symmetric memory unavailable (%s); layer "
                           "outputs are summed by NCCL", error or "on another rank")
            return False
        self._fast = state
        logger.info("layer outputs up to %d KiB are summed by a one-shot all-reduce on "
                    "symmetric memory (SPLASH_FAST_ALLREDUCE=1)", max_bytes >> 10)
        return True

    def all_gather_same(self, t: torch.Tensor) -> torch.Tensor:
        """(…) on every rank → (T, …), rank order."""
        if self.world == 1:
            return t.unsqueeze(0)
        t = t.contiguous()
        flat = t.reshape(1, -1) if t.dim() == 0 else t
        out = flat.new_empty((self.world * flat.shape[0], *flat.shape[1:]))  # gloo: concat dim 0
        _all_gather(out, flat, group=self.group)
        return out.view(self.world, *t.shape)

    def all_gather_rows(self, t: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Variable-size row all-gather: rank r contributes counts[r] rows of t (n, …);
        returns the concatenation in rank order (sum(counts), …). Pads to the largest."""
        if self.world == 1:
            return t
        width = max(max(counts), 1)
        padded = t.new_zeros((width, *t.shape[1:]))
        padded[: t.shape[0]] = t
        gathered = self.all_gather_same(padded)  # (T, width, …)
        return torch.cat([gathered[r, : counts[r]] for r in range(self.world)])

    def all_to_all_rows(
        self,
        send: torch.Tensor,
        send_counts: list[int],
        recv_counts: list[int],
        group=None,
        async_op: bool = False,
    ):
        """Uneven all-to-all of rows: send (sum(send_counts), …) in destination order; returns
        (recv (sum(recv_counts), …) in source order, work handle or None). Ranks with no rows
        still enter the collective."""
        recv = send.new_empty((sum(recv_counts), *send.shape[1:]))
        if self.world == 1:
            recv.copy_(send)
            return recv, None
        work = dist.all_to_all_single(
            recv,
            send.contiguous(),
            output_split_sizes=recv_counts,
            input_split_sizes=send_counts,
            group=group if group is not None else self.group,
            async_op=async_op,
        )
        return recv, work
