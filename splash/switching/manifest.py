"""Switch manifests derived from the ownership model.

For every rank the manifest says which projection heads and which KV pages it keeps, repacks
(kept, new local index), discards, and receives — and from whom. Nothing here knows the twelve
directions by name: each page's holders and each rank's heads under the source and destination
layouts are compared, and the difference is what moves. `build_manifest` chains four steps:
owners under the destination (`destination_owners`), one `PagePlan` per destination page
(`plan_pages`), fresh pages for the received ones and the row moves (`place_pages`), and the head
moves (`weight_moves`). Pure CPU; no device tensors.

A background switch builds two: the pre-copy moves each request's rows as they are when it
starts; the handoff moves only the rows written since (``rows_from``) into the pages the
pre-copy placed (``staged``), with the pre-copy's owners.

Pages are shared (reference counted): a full page several histories hold moves once and stays
shared at the destination (a partly filled one is copied per holder: they write different rows
next). Besides the requests, a manifest may carry unreferenced cached chains (`CachedHistory`):
they move when their pages fit, and hold their pages only for the switch step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from splash.core.allocator import RankAllocators
from splash.core.ownership import (
    KVPlacement,
    Layout,
    assign_owners,
    heads_held,
    local_page_index,
    page_holders,
)
from splash.core.prefix_cache import CachedHistory
from splash.core.protocol import KVMove, WeightMove
from splash.core.request import Request

PageKey = tuple[str, int, int]  # (request id, logical page, destination rank)
History = Request | CachedHistory  # a request's pages, or an unreferenced cached chain


@dataclass
class RankSummary:
    pages_kept: int = 0
    pages_repacked: int = 0  # kept in place, new local index (metadata only)
    pages_discarded: int = 0
    pages_received: int = 0
    kv_rows_received: int = 0
    kv_rows_sent: int = 0
    heads_kept: int = 0
    heads_received: int = 0
    heads_discarded: int = 0


@dataclass
class SwitchManifest:
    src: Layout
    dst: Layout
    weights: list[WeightMove]  # per rank
    kv: list[KVMove]  # per rank
    new_tables: dict[str, list[list[int]]]  # history -> per-rank local block tables
    new_owners: dict[str, int]
    discard: list[list[int]]  # per rank: requests' page references dropped once the step is done
    summary: list[RankSummary] = field(default_factory=list)
    placed: dict[PageKey, int] = field(default_factory=dict)  # requests' received pages, where
    #   they went: one reference each (a page k requests share is placed k times)
    cached: list[CachedHistory] = field(default_factory=list)  # cached chains moved along
    release: list[list[int]] = field(default_factory=list)  # per rank: references held for
    #   the step only (cached chains' pages, received pages no request holds)

    def give_back(self, allocators: RankAllocators) -> None:
        """Drop every page reference building this manifest took (it will not be carried
        out). Only for a manifest built without staged pages."""
        for rank, pages in enumerate(self.release):
            allocators[rank].free(pages)
        for (_, _, rank), page in self.placed.items():
            allocators[rank].free([page])

    @property
    def kv_op(self) -> str:
        if not any(s.kv_rows_received for s in self.summary):
            return "discard" if any(s.pages_discarded for s in self.summary) else "keep"
        return "all-gather" if self.dst.kv is KVPlacement.REPLICATED else "all-to-all"

    @property
    def weight_op(self) -> str:
        if any(s.heads_received for s in self.summary):
            return "all-gather"
        return "discard" if any(s.heads_discarded for s in self.summary) else "keep"

    def predicted_bytes(self, kv_row_bytes: int, head_bytes: int, num_layers: int,
                        index_bytes_per_row: int = 0) -> dict:
        """Bytes each rank receives over the whole switch (all layers); a KV row also carries
        ``index_bytes_per_row`` (DSA indexer keys of every indexer layer, same slot)."""
        kv = [s.kv_rows_received * (kv_row_bytes * num_layers + index_bytes_per_row)
              for s in self.summary]
        w = [s.heads_received * head_bytes * num_layers for s in self.summary]
        return {"kv_bytes_received": kv, "weight_bytes_received": w}


class PagePlan(NamedTuple):
    """One destination page of one request on one rank: kept in place or received (a tuple:
    a switch plans one per page, and building them is the controller's hot loop)."""

    request: History
    logical: int  # logical page of the request
    rank: int  # the destination rank that holds it
    page: int  # the kept page, or the page a pre-copy staged it in (-1: a fresh one)
    source: tuple[int, int] | None  # (rank, page) it is copied from when received
    rows: range  # the page's rows to move (offsets in the page; received pages only)
    shared: bool = False  # a full page an earlier plan receives already: no rows of its own


@dataclass
class PagePlacement:
    """The destination tables and the row moves, once received pages have their pages."""

    new_tables: dict[str, list[list[int]]]  # history -> per-rank local block tables
    send: list[list[list[int]]]  # [src][dst]: runs (first slot, rows) src sends to dst
    recv: list[list[list[int]]]  # [dst][src]: runs dst writes, in the same order
    kept: list[set[int]]  # per rank: pages kept in place
    placed: dict[PageKey, int]  # requests' received pages: where they went
    users: list[dict[int, int]] = field(default_factory=list)  # rank: fresh page -> requests


def destination_owners(src: Layout, dst: Layout, requests: list[History], world: int,
                       owners: dict[str, int] | None = None) -> dict[str, int]:
    """Owners kept between owned layouts; entering an owned layout places them with
    `ownership.assign_owners` over the live KV tokens (the cost model places them the same;
    cached chains are balanced among themselves; histories sharing pages may land on
    different owners, each then holding its own copy). ``owners`` (a pre-copy's) are kept;
    requests it lacks (admitted meanwhile) are placed by the same rules."""
    fixed = owners or {}
    fresh = [r for r in requests if r.request_id not in fixed]
    new: dict[str, int] = {}
    if dst.uses_owners and not src.uses_owners:
        reqs: list[History] = [r for r in fresh if not isinstance(r, CachedHistory)]
        chains: list[History] = [r for r in fresh if isinstance(r, CachedHistory)]
        for part in (reqs, chains):
            placed = assign_owners([r.num_computed for r in part], world)
            new.update({r.request_id: int(o) for r, o in zip(part, placed)})
    else:
        new = {r.request_id: r.owner for r in fresh}
    return {**fixed, **new} if fixed else new


def plan_pages(src: Layout, dst: Layout, requests: list[History], owners: dict[str, int],
               world: int, page_size: int, rows_from: dict[str, int] | None = None,
               staged: dict[PageKey, int] | None = None) -> list[PagePlan]:
    """Every destination page of every request, in logical order per request: kept where the
    source already holds it, else received from its first source holder — its rows from
    ``rows_from`` (rows already moved per request) on, into its ``staged`` page if any. A full
    page an earlier plan already receives onto the same rank is ``shared`` (moves once)."""
    rows_from, staged = rows_from or {}, staged or {}
    received: set[tuple[int, int, int]] = set()  # full (source rank, page, destination rank)
    plans = []
    for req in requests:
        done = rows_from.get(req.request_id, 0)
        n = -(-req.num_computed // page_size)
        src_holders = _holders(src, n, req.owner, world)
        dst_holders = _holders(dst, n, owners[req.request_id], world)
        for i in range(n):
            rows = range(max(done - i * page_size, 0),
                         min(page_size, req.num_computed - i * page_size))
            src_h = src_holders[i]
            src_local = local_page_index(src, i, world)
            for d in dst_holders[i]:
                if d in src_h:
                    plans.append(PagePlan(req, i, d, req.tables[d][src_local], None, rows))
                    continue
                s = src_h[0]
                source = (s, req.tables[s][src_local])
                page = staged.get((req.request_id, i, d), -1)
                full = req.num_computed >= (i + 1) * page_size
                if page < 0 and full and (*source, d) in received:
                    plans.append(PagePlan(req, i, d, page, source, range(0), shared=True))
                    continue
                if page < 0 and full:
                    received.add((*source, d))
                plans.append(PagePlan(req, i, d, page, source, rows))
    return plans


def _holders(layout: Layout, num_pages: int, owner: int, world: int) -> list[tuple[int, ...]]:
    """`page_holders` of a request's first ``num_pages`` logical pages, in one go."""
    if layout.kv is KVPlacement.POSITION_SHARDED:
        return [page_holders(layout, i, owner, world) for i in range(num_pages)]
    return [page_holders(layout, 0, owner, world)] * num_pages


def received_pages(plans: list[PagePlan], world: int) -> list[int]:
    """Fresh pages each rank needs for the pages it receives (staged ones have theirs)."""
    need = [0] * world
    for p in plans:
        need[p.rank] += p.source is not None and p.page < 0 and not p.shared
    return need


def place_pages(plans: list[PagePlan], fresh: list[list[int]], world: int,
                page_size: int) -> PagePlacement:
    """Destination tables (kept, staged and ``fresh`` pages, in logical order) and the runs of
    slots each received page's rows move between (one run per page)."""
    fresh_iter = [iter(pages) for pages in fresh]
    out = PagePlacement({}, [[[] for _ in range(world)] for _ in range(world)],
                        [[[] for _ in range(world)] for _ in range(world)],
                        [set() for _ in range(world)], {},
                        [{p: 0 for p in pages} for pages in fresh])
    moved: dict[tuple[int, int, int], int] = {}  # full (source rank, page, rank) -> its page
    for p in plans:
        table = out.new_tables.get(p.request.request_id)
        if table is None:
            table = out.new_tables[p.request.request_id] = [[] for _ in range(world)]
        page = p.page
        if p.source is None:
            out.kept[p.rank].add(page)
        else:
            s, src_page = p.source
            if p.shared:
                page = moved[(s, src_page, p.rank)]
            elif page < 0:
                page = next(fresh_iter[p.rank])
                moved[(s, src_page, p.rank)] = page
            if not isinstance(p.request, CachedHistory):
                out.placed[(p.request.request_id, p.logical, p.rank)] = page
                if page in out.users[p.rank]:
                    out.users[p.rank][page] += 1
            if p.rows:
                out.send[s][p.rank] += [src_page * page_size + p.rows.start, len(p.rows)]
                out.recv[p.rank][s] += [page * page_size + p.rows.start, len(p.rows)]
        table[p.rank].append(page)  # logical pages visited in order, so local order holds
    return out


def weight_moves(src: Layout, dst: Layout, world: int, num_heads: int) -> list[WeightMove]:
    """Per rank: the heads it must hold under ``dst`` and which it receives from (the lowest)
    source holder, and which it sends."""
    held_src = [set(heads_held(src, r, world, num_heads)) for r in range(world)]

    def sender(h: int) -> int:
        return min(r for r in range(world) if h in held_src[r])

    moves = []
    for rank in range(world):
        need = heads_held(dst, rank, world, num_heads)
        recv: list[list[int]] = [[] for _ in range(world)]
        send: list[list[int]] = [[] for _ in range(world)]
        for h in need:
            if h not in held_src[rank]:
                recv[sender(h)].append(h)
        for d in range(world):
            for h in heads_held(dst, d, world, num_heads):
                if h not in held_src[d] and sender(h) == rank:
                    send[d].append(h)
        moves.append(WeightMove(need.start, need.stop, recv, send))
    return moves


def _summaries(src: Layout, dst: Layout, plans: list[PagePlan], discard: list[list[int]],
               weights: list[WeightMove], world: int, num_heads: int) -> list[RankSummary]:
    summary = [RankSummary() for _ in range(world)]
    kept: set[tuple[int, int]] = set()
    for p in plans:
        if p.source is None:
            if (p.rank, p.page) in kept:
                continue  # shared: counted once
            kept.add((p.rank, p.page))
            summary[p.rank].pages_kept += 1
            if local_page_index(src, p.logical, world) != local_page_index(dst, p.logical, world):
                summary[p.rank].pages_repacked += 1
            continue
        # a staged page was counted before; a shared one with its first receiver
        summary[p.rank].pages_received += p.page < 0 and not p.shared
        summary[p.rank].kv_rows_received += len(p.rows)
        summary[p.source[0]].kv_rows_sent += len(p.rows)
    for rank, mv in enumerate(weights):
        old = set(heads_held(src, rank, world, num_heads))
        new = set(range(mv.head_start, mv.head_stop))
        summary[rank].pages_discarded = len(set(discard[rank]) - {p for r, p in kept if r == rank})
        summary[rank].heads_received = sum(len(x) for x in mv.recv_from)
        summary[rank].heads_kept = len(old & new)
        summary[rank].heads_discarded = len(old - new)
    return summary


def _dropped(requests: list[History], new_tables: dict[str, list[list[int]]],
             world: int) -> list[list[int]]:
    """Per rank: the page references the requests hold under the source and not under the
    destination (a page stays held when another request keeps it)."""
    out: list[list[int]] = [[] for _ in range(world)]
    for req in requests:
        new = new_tables.get(req.request_id)
        for rank in range(world):
            keep = set(new[rank]) if new is not None else set()
            out[rank] += [p for p in req.tables[rank] if p not in keep]
    return out


def build_manifest(
    src: Layout,
    dst: Layout,
    requests: list[Request],
    allocators: RankAllocators,
    world: int,
    page_size: int,
    num_heads: int,
    owners: dict[str, int] | None = None,
    rows_from: dict[str, int] | None = None,
    staged: dict[PageKey, int] | None = None,
    cached: list[CachedHistory] | None = None,
) -> SwitchManifest | None:
    """The manifest for switching ``requests`` (with their current tables) from ``src`` to
    ``dst``, allocating destination pages; None (nothing allocated) when the pages needed do
    not fit — the caller defers the switch. A handoff passes the pre-copy's ``owners``, the
    rows it moved per request (``rows_from``, absent = 0) and the pages it placed (``staged``);
    a page a destination rank already holds under ``src`` is kept and never moves.
    ``cached`` chains (pinned here for the step) move along when their pages fit beside the
    requests'; otherwise they stay where they are."""
    if cached:
        for h in cached:  # pinned: the allocation below must not evict what moves or stays
            for rank, pages in enumerate(h.tables):
                allocators[rank].incref(pages)
        m = _build(src, dst, [*requests, *cached], allocators, world, page_size, num_heads,
                   owners, rows_from, staged)
        if m is not None:
            m.cached = list(cached)
            for h in cached:
                for rank, pages in enumerate(h.tables):
                    m.release[rank] += pages
            return m
        for h in cached:
            for rank, pages in enumerate(h.tables):
                allocators[rank].free(pages)
    return _build(src, dst, list(requests), allocators, world, page_size, num_heads, owners,
                  rows_from, staged)


def _build(src: Layout, dst: Layout, histories: list[History], allocators: RankAllocators,
           world: int, page_size: int, num_heads: int, owners: dict[str, int] | None,
           rows_from: dict[str, int] | None, staged: dict[PageKey, int] | None
           ) -> SwitchManifest | None:
    owners = destination_owners(src, dst, histories, world, owners)
    plans = plan_pages(src, dst, histories, owners, world, page_size, rows_from, staged)
    need = received_pages(plans, world)
    if not allocators.can_allocate(need):
        return None
    placed = place_pages(plans, allocators.allocate(need), world, page_size)
    # a fresh page starts with one reference: one more per further request holding it, and
    # none kept for pages only cached chains hold (released after the step)
    release: list[list[int]] = [[] for _ in range(world)]
    for rank, users in enumerate(placed.users):
        for page, n in users.items():
            if n == 0:
                release[rank].append(page)
            elif n > 1:
                allocators[rank].incref([page] * (n - 1))
    discard = _dropped([h for h in histories if not isinstance(h, CachedHistory)],
                       placed.new_tables, world)
    weights = weight_moves(src, dst, world, num_heads)
    kv = [KVMove(placed.send[r], placed.recv[r]) for r in range(world)]
    summary = _summaries(src, dst, plans, discard, weights, world, num_heads)
    return SwitchManifest(src, dst, weights, kv, placed.new_tables, owners, discard, summary,
                          placed.placed, release=release)
