"""Continuous batching with chunked prefill, page-based admission and preemption by recompute.

The scheduler owns every rank's page tables and every request's state: it schedules a step,
applies a switch's new tables and owners, and after the step appends the sampled tokens and
finishes the requests that stop (`update_from_output`). Which ranks hold a request's pages is
decided by the current layout's KV placement (`ownership.num_local_pages`), so the same code
batches for all four layouts.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from splash.core.allocator import RankAllocators
from splash.core.ownership import Layout, least_loaded, num_local_pages
from splash.core.request import Request, Status
from splash.logging_utils import get_logger
from splash.switching.manifest import SwitchManifest

logger = get_logger("splash.scheduler")


@dataclass(frozen=True)
class SchedulerConfig:
    world: int
    page_size: int
    max_model_len: int
    max_num_seqs: int = 256  # requests in one step
    max_num_batched_tokens: int = 512  # rows in one step (the prefill chunk budget)
    enable_chunked_prefill: bool = True
    eos_token_ids: tuple[int, ...] = ()  # the model's end-of-sequence tokens

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("page_size, max_num_seqs and max_num_batched_tokens must be > 0")


@dataclass
class ScheduledBatch:
    entries: list[tuple[Request, int]] = field(default_factory=list)  # (request, new rows)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return sum(n for _, n in self.entries)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, allocators: RankAllocators, layout: Layout) -> None:
        self.cfg = cfg
        self.alloc = allocators
        self.layout = layout
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.hold_admission = False  # set while a deferred switch waits for pages
        self.dirty: list[dict[str, int]] = [{} for _ in range(cfg.world)]  # rank: rid -> start
        self.released: list[str] = []
        self.num_preemptions = 0

    # -- bookkeeping ----------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.tables = [[] for _ in range(self.cfg.world)]
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def live_tokens_by_rank(self) -> list[int]:
        """KV tokens per owner rank, counting rows already scheduled (pages taken) this step."""
        load = [0] * self.cfg.world
        for r in self.running:
            held = len(r.tables[r.owner]) * self.cfg.page_size if self.layout.uses_owners else 0
            load[r.owner] += max(r.num_computed, held)
        return load

    def requests_by_rank(self) -> list[int]:
        count = [0] * self.cfg.world
        for r in self.running:
            count[r.owner] += 1
        return count

    def free(self, req: Request) -> None:
        for rank, pages in enumerate(req.tables):
            if pages:
                self.alloc[rank].free(pages)
            self.dirty[rank].pop(req.request_id, None)
        req.tables = [[] for _ in range(self.cfg.world)]
        self.released.append(req.request_id)

    def finish(self, req: Request, reason: str, error: str | None = None) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.free(req)
        req.status, req.finish_reason, req.error = Status.FINISHED, reason, error

    def mark_dirty(self, req: Request, rank: int, start: int) -> None:
        rid = req.request_id
        self.dirty[rank][rid] = min(self.dirty[rank].get(rid, start), start)

    # -- pages ----------------------------------------------------------------------------
    def pages_needed(self, req: Request, num_tokens: int, layout: Layout | None = None) -> list[int]:
        layout = layout or self.layout
        logical = -(-num_tokens // self.cfg.page_size)
        return [
            max(num_local_pages(layout, logical, r, req.owner, self.cfg.world) - len(t), 0)
            for r, t in enumerate(req.tables)
        ]

    def _grow(self, req: Request, num_tokens: int) -> bool:
        need = self.pages_needed(req, num_tokens)
        if not any(need):  # most decode steps: the last page still has room
            return True
        if not self.alloc.can_allocate(need):
            return False
        for rank, pages in enumerate(self.alloc.allocate(need)):
            if pages:
                self.mark_dirty(req, rank, len(req.tables[rank]))
                req.tables[rank].extend(pages)
        return True

    def _pick_owner(self, req: Request, num_tokens: int) -> int | None:
        """The least-loaded rank (`ownership.least_loaded`); under an owned layout only ranks
        with room for the request's pages. Owners matter only under owned layouts, but are
        kept balanced under the others too."""
        ranks = None
        if self.layout.uses_owners:
            pages = -(-num_tokens // self.cfg.page_size)
            ranks = [r for r in range(self.cfg.world) if self.alloc[r].num_available >= pages]
        return least_loaded(self.live_tokens_by_rank(), self.requests_by_rank(), ranks)

    # -- one step -------------------------------------------------------------------------
    def schedule(self, allow_preemption: bool = True) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.cfg.max_num_batched_tokens
        for req in list(self.running):  # decodes and unfinished prefills, oldest first
            if req not in self.running:
                continue  # preempted below to make room for an older request
            n = self._chunk(req, budget)
            if n == 0:
                continue
            while not self._grow(req, req.num_computed + n):
                victim = self.running[-1] if allow_preemption else None
                if victim is None or victim is req:
                    n = 0
                    if allow_preemption and len(self.running) == 1:
                        self.finish(req, "error", "out of KV memory: the request does not fit")
                    break
                self._preempt(victim, batch)
            if n:
                batch.entries.append((req, n))
                budget -= n
        if not self.hold_admission and not batch.preempted:
            self._admit(batch, budget)
        return batch

    def _chunk(self, req: Request, budget: int) -> int:
        if req.num_pending <= 1:
            return min(req.num_pending, budget)
        if not self.cfg.enable_chunked_prefill:
            return req.num_pending if budget == self.cfg.max_num_batched_tokens else 0
        return min(req.num_pending, budget)

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            n = self._chunk(req, budget)
            if n == 0:
                break
            owner = self._pick_owner(req, req.num_computed + n)
            if owner is None:
                break
            req.owner = owner
            if not self._grow(req, req.num_computed + n):
                break  # first come, first served: wait for pages
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            batch.entries.append((req, n))
            budget -= n

    def _preempt(self, victim: Request, batch: ScheduledBatch) -> None:
        logger.info("preempting %s (recompute): KV pages exhausted", victim.request_id)
        self.running.remove(victim)
        batch.entries = [(r, n) for r, n in batch.entries if r is not victim]
        self.free(victim)
        victim.num_computed = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        victim.status = Status.WAITING
        self.waiting.appendleft(victim)
        batch.preempted.append(victim)

    def take_table_updates(self, rank: int) -> list[tuple[str, int, list[int]]]:
        """Block-table changes for ``rank`` since the last call, for running requests."""
        updates = []
        by_id = {r.request_id: r for r in self.running}
        for rid, start in self.dirty[rank].items():
            req = by_id.get(rid)
            if req is not None:
                updates.append((rid, start, req.tables[rank][start:]))
        self.dirty[rank].clear()
        return updates

    # -- a switch, and a step's results --------------------------------------------------
    def apply_switch(self, manifest: SwitchManifest) -> None:
        """Adopt a planned switch: the running requests' destination tables and owners, the
        destination layout; every rank's tables are re-sent with the step."""
        for req in self.running:
            req.tables = manifest.new_tables.get(req.request_id,
                                                 [[] for _ in range(self.cfg.world)])
            req.owner = manifest.new_owners.get(req.request_id, req.owner)
            for rank in range(self.cfg.world):
                self.mark_dirty(req, rank, 0)
        self.layout = manifest.dst

    def update_from_output(self, batch: ScheduledBatch, tokens: list[int]) -> list[Request]:
        """Advance every scheduled request by its rows, append the tokens sampled for the
        requests whose prompt and outputs are now all computed (in batch order), and finish
        those that stop. Returns the requests that got a token."""
        sampled = []
        it = iter(tokens)
        for req, n in batch.entries:
            req.num_computed += n
            if req.num_computed < req.num_tokens:
                continue  # a prefill chunk short of the prompt's end: nothing sampled
            token = next(it)
            if req.status is Status.FINISHED:
                continue
            req.output_token_ids.append(token)
            if req.first_token_s is None:
                req.first_token_s = time.monotonic()
            reason = self._stop_reason(req, token)
            if reason:
                self.finish(req, reason)
            sampled.append(req)
        return sampled

    def _stop_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        if not p.ignore_eos and token in self.cfg.eos_token_ids:
            return "stop"
        if p.stop_token_ids and token in p.stop_token_ids:
            return "stop"
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.cfg.max_model_len:
            return "length"
        return None
