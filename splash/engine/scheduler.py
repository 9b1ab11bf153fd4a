"""Continuous batching with chunked prefill, page-based admission and preemption by recompute.

The scheduler owns every rank's page tables and every request's state: it schedules a step,
applies a switch's new tables and owners, and after the step appends the sampled tokens and
finishes the requests that stop (`update_from_output`). Which ranks hold a request's pages is
decided by the current layout's KV placement (`ownership.num_local_pages`), so the same code
batches for all four layouts.

Pages are shared (reference counted): a request admitted with a cached prefix takes the cached
pages (`splash.core.prefix_cache`), a prefill that reaches pages another request computed in
the meantime takes them too, and the n samples of a prompt fork off sharing its pages. A row is
never written into a shared page: the writer first copies it (copy-on-write; the copy runs on
the workers before the step computes).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import msgspec

from splash.core.allocator import RankAllocators
from splash.core.ownership import (
    Layout,
    least_loaded,
    local_page_index,
    num_local_pages,
    page_holders,
)
from splash.core.prefix_cache import PrefixCache
from splash.core.protocol import StepResult
from splash.core.request import Request, Status
from splash.engine.output_processor import OutputProcessor
from splash.engine.sampling_plan import num_draws, prompt_logprob_rows
from splash.logging_utils import get_logger
from splash.sampling_params import sample_seed
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
    enable_prefix_caching: bool = True
    eos_token_ids: tuple[int, ...] = ()  # the model's end-of-sequence tokens

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("page_size, max_num_seqs and max_num_batched_tokens must be > 0")


@dataclass
class ScheduledBatch:
    entries: list[tuple[Request, int]] = field(default_factory=list)  # (request, new rows)
    preempted: list[Request] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # per entry: its first row's position
    samples: list[bool] = field(default_factory=list)  # per entry: draws after this step
    advanced: bool = False  # its rows and draws are counted already (`Scheduler.advance`)
    starved: bool = False  # a request got no rows for want of pages (preemption was not allowed)

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
        self.copies: list[list[list[int]]] = [[] for _ in range(cfg.world)]  # rank: [src, dst]
        self.num_preemptions = 0
        self.prompt_tokens_computed = 0  # prefill work: prompt rows computed
        self.prefix = PrefixCache(allocators, cfg.world, cfg.page_size, cfg.enable_prefix_caching)
        self._unregistered: tuple[list, Layout] | None = None  # a switch's moved histories

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
        self._drop_pages(req)
        self.released.append(req.request_id)

    def _drop_pages(self, req: Request) -> None:
        for rank, pages in enumerate(req.tables):
            if pages:
                self.alloc[rank].free(pages)
            self.dirty[rank].pop(req.request_id, None)
        req.tables = [[] for _ in range(self.cfg.world)]
        req.num_cached_pages = 0

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
        shared = self._shared_tail(req)
        if not any(need) and not shared:  # most decode steps: the last page still has room
            return True
        for rank in shared:
            need[rank] += 1
        if not self.alloc.can_allocate(need):
            return False
        for rank, pages in enumerate(self.alloc.allocate(need)):
            if rank in shared:  # copy-on-write: the next row lands in a page others hold
                local, page = shared[rank], pages.pop()
                self.copies[rank].append([req.tables[rank][local], page])
                self.alloc[rank].free([req.tables[rank][local]])
                req.tables[rank][local] = page
                self.mark_dirty(req, rank, local)
            if pages:
                self.mark_dirty(req, rank, len(req.tables[rank]))
                req.tables[rank].extend(pages)
        return True

    def _shared_tail(self, req: Request) -> dict[int, int]:
        """rank -> local index of the partly filled page the next row writes, where that page
        is shared with other requests (the samples of one prompt)."""
        ps = self.cfg.page_size
        if req.num_computed % ps == 0:
            return {}
        logical = req.num_computed // ps
        local = local_page_index(self.layout, logical, self.cfg.world)
        return {d: local for d in page_holders(self.layout, logical, req.owner, self.cfg.world)
                if local < len(req.tables[d])
                and self.alloc[d].refcount(req.tables[d][local]) > 1}

    def _take_cached(self, req: Request, found: list[list[tuple[int, int]]]) -> None:
        """Continue ``req``'s history with cached pages (from ``PrefixCache.match``)."""
        if not found:
            return
        start = [len(t) for t in req.tables]
        for holders in found:
            for rank, page in holders:
                self.alloc[rank].incref([page])
                req.tables[rank].append(page)
        for rank, t in enumerate(req.tables):
            if len(t) > start[rank]:
                self.mark_dirty(req, rank, start[rank])
        req.num_computed += len(found) * self.cfg.page_size
        req.num_cached_pages = req.num_computed // self.cfg.page_size
        self.prefix.hit_tokens += len(found) * self.cfg.page_size

    def _place(self, req: Request, num_tokens: int) -> tuple[int | None, list]:
        """Owner rank and cached pages for an admission: the least-loaded rank
        (`ownership.least_loaded`; under an owned layout only ranks with room for the pages the
        request still needs), except that under owned KV (DP, DOP) a rank holding a longer
        cached prefix wins unless that would unbalance the ranks — its live tokens exceed the
        least-loaded rank's by more than a prefill chunk and by a quarter (the two thresholds
        of SGLang's cache-aware router)."""
        load, count = self.live_tokens_by_rank(), self.requests_by_rank()
        if not self.layout.uses_owners:  # owners matter only after a switch to an owned layout
            least = least_loaded(load, count)
            assert least is not None
            return least, self.prefix.match(req, self.layout, least)
        pages = -(-num_tokens // self.cfg.page_size)
        found = {r: self.prefix.match(req, self.layout, r) for r in range(self.cfg.world)}
        fits = [r for r in found if self.alloc[r].num_available >= pages - len(found[r])]
        least = least_loaded(load, count, fits)
        if least is None:
            return None, []
        longest = max(len(found[r]) for r in fits)
        best = least_loaded(load, count, [r for r in fits if len(found[r]) == longest])
        assert best is not None
        excess = load[best] - load[least]
        if excess > self.cfg.max_num_batched_tokens and load[best] > 1.25 * load[least]:
            logger.debug("%s placed on rank %d, not on rank %d with %d cached tokens: %d more "
                         "live tokens there", req.request_id, least, best,
                         longest * self.cfg.page_size, excess)
            return least, found[least]
        return best, found[best]

    # -- one step -------------------------------------------------------------------------
    def schedule(self, allow_preemption: bool = True) -> ScheduledBatch:
        if self.waiting or any(r.num_pending > 1 for r in self.running):
            self.register_switched()  # admissions and prefills look the cache up
        batch = ScheduledBatch()
        budget = self.cfg.max_num_batched_tokens
        for req in list(self.running):  # decodes and unfinished prefills, oldest first
            if req not in self.running:
                continue  # preempted below to make room for an older request
            if req.num_pending > 1:  # a prefill may reach pages computed meanwhile
                self._take_cached(req, self.prefix.match(req, self.layout, req.owner))
            n = self._chunk(req, budget)
            if n == 0:
                continue
            while not self._grow(req, req.num_computed + n):
                victim = self.running[-1] if allow_preemption else None
                if victim is None or victim is req:
                    n = 0
                    batch.starved |= not allow_preemption
                    if allow_preemption and len(self.running) == 1:
                        self.finish(req, "error", "out of KV memory: the request does not fit")
                    break
                self._preempt(victim, batch)
            if n:
                batch.entries.append((req, n))
                budget -= n
                self.prefix.register(req, self.layout, req.num_computed + n)
        if not self.hold_admission and not batch.preempted:
            self._admit(batch, budget)
        batch.starts = [req.num_computed for req, _ in batch.entries]
        batch.samples = [req.num_computed + n == req.num_tokens + req.pending
                         for req, n in batch.entries]
        return batch

    def advance(self, batch: ScheduledBatch) -> None:
        """Count ``batch`` as computed while it is still in flight, so that the next step can
        be scheduled now (asynchronous scheduling): its rows are computed and each draw is a
        token in flight. Only for batches drawing one token per request."""
        draw = 0
        for (req, n), start, sample in zip(batch.entries, batch.starts, batch.samples):
            req.num_computed = start + n
            if sample:
                assert num_draws(req) == 1 and not req.pending
                req.pending, req.pending_draw = 1, draw
                draw += 1
        batch.advanced = True

    def _chunk(self, req: Request, budget: int) -> int:
        if req.pending and self._stops_with_pending(req):
            return 0  # its token in flight is its last: nothing more to compute
        if req.num_pending <= 1:
            return min(req.num_pending, budget)
        # a step never exceeds max_num_batched_tokens rows (the profiled size): without
        # chunked prefill a prompt runs whole in an otherwise empty step, but a preempted
        # request longer than that (prompt and outputs) recomputes in chunks
        whole = req.num_pending <= self.cfg.max_num_batched_tokens
        if not self.cfg.enable_chunked_prefill and whole:
            return req.num_pending if budget == self.cfg.max_num_batched_tokens else 0
        return min(req.num_pending, budget)

    def _stops_with_pending(self, req: Request) -> bool:
        """Whether the token in flight ends ``req`` by length (other stops are seen only once
        it is known: the step after it computes one row for nothing)."""
        return req.num_outputs >= req.params.max_tokens or \
            req.num_tokens + req.pending >= self.cfg.max_model_len

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            if self._chunk(req, budget) == 0:
                break
            owner, found = self._place(req, req.num_computed + min(req.num_pending, budget))
            if owner is None:
                break
            req.owner = owner
            hits_before = self.prefix.hit_tokens
            self._take_cached(req, found)
            n = self._chunk(req, budget)
            if n == 0 or not self._grow(req, req.num_computed + n):
                self.prefix.hit_tokens = hits_before
                self._drop_pages(req)
                req.num_computed = 0
                break  # first come, first served: wait for pages
            self.prefix.queried_tokens += req.num_tokens if self.prefix.enabled else 0
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            batch.entries.append((req, n))
            budget -= n
            self.prefix.register(req, self.layout, req.num_computed + n)

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

    def fork(self, parent: Request) -> list[Request]:
        """The other n - 1 samples of ``parent``'s prompt, now that it is prefilled: they run
        right after it, sharing its pages, each with its own seed stream."""
        group = parent.group
        assert group is not None
        children = []
        for i in range(1, group.n):
            params = msgspec.structs.replace(parent.params, n=1,
                                             seed=sample_seed(parent.params.seed, i))
            child = Request(f"{group.request_id}\x1e{i}", parent.prompt_token_ids, params,
                            arrival_s=parent.arrival_s, group=group, sample_index=i,
                            owner=parent.owner, num_computed=parent.num_computed,
                            tables=[list(t) for t in parent.tables],
                            status=Status.RUNNING, block_hashes=list(parent.block_hashes),
                            num_cached_pages=parent.num_cached_pages)
            for rank, pages in enumerate(child.tables):
                if pages:
                    self.alloc[rank].incref(pages)
                    self.mark_dirty(child, rank, 0)
            children.append(child)
        group.members += children
        at = self.running.index(parent) + 1
        self.running[at:at] = children
        return children

    def take_copies(self, rank: int) -> list[list[int]]:
        copies, self.copies[rank] = self.copies[rank], []
        return copies

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
        for chain in manifest.cached:
            chain.tables = manifest.new_tables[chain.request_id]
            chain.owner = manifest.new_owners[chain.request_id]
        # the moved pages join the prefix cache under their keys on their new holders later,
        # once the step is submitted (`register_switched`), or before anything looks the cache
        # up — whichever comes first
        self._unregistered = ([*self.running, *manifest.cached], manifest.dst)
        self.layout = manifest.dst

    def register_switched(self) -> None:
        """Register the pages the last switch moved in the prefix cache. Deferred from
        `apply_switch` so that it runs while the device computes the switching step; it must
        run before any cache lookup and before any of those pages is freed. Pages received in
        the switching step are hits from then on: a request admitted into that very step reads
        them in each layer only after that layer's transfer has landed."""
        if self._unregistered is None:
            return
        hists, layout = self._unregistered
        self._unregistered = None
        for hist in hists:
            self.prefix.register_moved(hist, layout)

    def update_from_output(self, batch: ScheduledBatch, result: StepResult,
                           out: OutputProcessor) -> list[Request]:
        """Advance every scheduled request by its rows, record its prompt logprobs, append the
        tokens (and logprobs) sampled for the requests whose prompt and outputs are now all
        computed (in batch order; an n-sample prompt's last row forks its samples), and finish
        those that stop (``out`` decides). Returns the requests that got a token."""
        sampled = []
        tokens, logprobs = iter(result.tokens), iter(result.logprobs)
        prompt_logprobs = iter(result.prompt_logprobs)
        for b, (req, n) in enumerate(batch.entries):
            start, sample = batch.starts[b], batch.samples[b]
            if prompt_logprob_rows(req, b, start, n) is not None:
                out.add_prompt_logprobs(req, next(prompt_logprobs))
            self.prompt_tokens_computed += max(min(start + n, len(req.prompt_token_ids)) - start,
                                               0)
            if not batch.advanced:
                req.num_computed += n
            if not sample:
                continue  # a prefill chunk short of the prompt's end: nothing sampled
            if batch.advanced:
                req.pending = 0
            draws = num_draws(req)
            toks = [next(tokens) for _ in range(draws)]
            lps = [next(logprobs) if req.params.logprobs is not None else None for _ in toks]
            if req.status is Status.FINISHED:
                continue
            samples = [req]
            if draws > 1:
                samples += self.fork(req)
                for child in samples[1:]:
                    out.start(child)
            for member, token, lp in zip(samples, toks, lps):
                if member.first_token_s is None:
                    member.first_token_s = time.monotonic()
                reason = out.append(member, token, lp)
                if reason:
                    self.finish(member, reason)
                sampled.append(member)
        return sampled
