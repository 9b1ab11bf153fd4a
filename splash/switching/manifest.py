"""Switch manifests derived from the ownership model.

For every rank the manifest says which projection heads and which KV pages it keeps, repacks
(kept, new local index), discards, and receives — and from whom. Nothing here knows the twelve
directions by name: each page's holders and each rank's heads under the source and destination
layouts are compared, and the difference is what moves. `build_manifest` chains four steps:
owners under the destination (`destination_owners`), the plan of every destination page, kept
or received (`pages.plan_pages`, array operations over all pages at once), fresh pages for the
received ones and the row moves (`pages.place_pages`), and the head moves (`weight_moves`).
Pure CPU; no device tensors.

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

from splash.core.allocator import RankAllocators
from splash.core.ownership import KVPlacement, Layout, assign_owners, heads_held
from splash.core.prefix_cache import CachedHistory
from splash.core.protocol import KVMove, WeightMove
from splash.core.request import Request
from splash.switching.pages import (
    History,
    Placed,
    free_placed,
    place_pages,
    plan_pages,
    received_pages,
)


@dataclass
class RankSummary:
    pages_kept: int = 0
    pages_repacked: int = 0  # kept in place, new local index (metadata only)
    pages_discarded: int = 0
    pages_received: int = 0
    pages_reused: int = 0  # taken from the rank's prefix cache (same key): nothing moved
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
    placed: Placed = field(default_factory=dict)  # requests' received pages: per request a
    #   (logical pages, world) array, -1 where none; one reference each (a page k requests
    #   share is placed k times)
    cached: list[CachedHistory] = field(default_factory=list)  # cached chains moved along
    release: list[list[int]] = field(default_factory=list)  # per rank: references held for
    #   the step only (cached chains' pages, received pages no request holds)

    def give_back(self, allocators: RankAllocators) -> None:
        """Drop every page reference building this manifest took (it will not be carried
        out). Only for a manifest built without staged pages."""
        for rank, pages in enumerate(self.release):
            allocators[rank].free(pages)
        free_placed(self.placed, allocators)

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


def weight_moves(src: Layout, dst: Layout, world: int, num_heads: int,
                 resident: bool = False) -> list[WeightMove]:
    """Per rank: the heads it must hold under ``dst`` and which it receives from (the lowest)
    source holder, and which it sends. ``resident``: every rank holds every layout's heads
    already, so nothing moves."""
    if resident:
        return [WeightMove(r.start, r.stop, [[] for _ in range(world)],
                           [[] for _ in range(world)])
                for r in (heads_held(dst, d, world, num_heads) for d in range(world))]
    sender = [world] * num_heads  # each head's lowest source holder
    for r in reversed(range(world)):
        for h in heads_held(src, r, world, num_heads):
            sender[h] = r
    need = [heads_held(dst, r, world, num_heads) for r in range(world)]
    recv: list[list[list[int]]] = [[[] for _ in range(world)] for _ in range(world)]  # [d][s]
    send: list[list[list[int]]] = [[[] for _ in range(world)] for _ in range(world)]  # [s][d]
    for d in range(world):
        held = heads_held(src, d, world, num_heads)
        for h in need[d]:
            if h not in held:
                recv[d][sender[h]].append(h)
                send[sender[h]][d].append(h)
    return [WeightMove(need[r].start, need[r].stop, recv[r], send[r]) for r in range(world)]


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
    staged: Placed | None = None,
    cached: list[CachedHistory] | None = None,
    resident_heads: bool = False,
) -> SwitchManifest | None:
    """The manifest for switching ``requests`` (with their current tables) from ``src`` to
    ``dst``, allocating destination pages; None (nothing allocated) when the pages needed do
    not fit — the caller defers the switch. A handoff passes the pre-copy's ``owners``, the
    rows it moved per request (``rows_from``, absent = 0) and the pages it placed (``staged``);
    a page a destination rank already holds under ``src`` is kept and never moves.
    ``cached`` chains (pinned here for the step) move along when their pages fit beside the
    requests'; otherwise they stay where they are. ``resident_heads``: every rank holds every
    layout's projection heads (no weight moves)."""
    if cached:
        for h in cached:  # pinned: the allocation below must not evict what moves or stays
            for rank, pages in enumerate(h.tables):
                allocators[rank].incref(pages)
        m = _build(src, dst, [*requests, *cached], allocators, world, page_size, num_heads,
                   owners, rows_from, staged, resident_heads)
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
                  rows_from, staged, resident_heads)


def _build(src: Layout, dst: Layout, histories: list[History], allocators: RankAllocators,
           world: int, page_size: int, num_heads: int, owners: dict[str, int] | None,
           rows_from: dict[str, int] | None, staged: Placed | None,
           resident_heads: bool) -> SwitchManifest | None:
    owners = destination_owners(src, dst, histories, world, owners)
    pool = max(a.num_pages for a in allocators.ranks)
    plan = plan_pages(src, dst, histories, owners, world, page_size, pool, rows_from, staged,
                      lookup=lambda rank, keys: allocators[rank].lookup_many(keys))
    reused = plan.reused_pages()
    for rank, pages in enumerate(reused):  # taken before allocating: never evicted for it
        allocators[rank].incref(pages)
    need = received_pages(plan)
    if not allocators.can_allocate(need):
        for rank, pages in enumerate(reused):
            allocators[rank].free(pages)
        return None
    placed = place_pages(plan, allocators.allocate(need))
    for rank, pages in enumerate(placed.incref):
        allocators[rank].incref(pages)
    weights = weight_moves(src, dst, world, num_heads, resident_heads)
    kv = [KVMove(placed.send[r], placed.recv[r]) for r in range(world)]
    summary = [RankSummary(**{k: int(v[r]) for k, v in placed.counts.items()})
               for r in range(world)]
    for rank, mv in enumerate(weights):
        new = set(range(mv.head_start, mv.head_stop))
        old = new if resident_heads else set(heads_held(src, rank, world, num_heads))
        summary[rank].heads_received = sum(len(x) for x in mv.recv_from)
        summary[rank].heads_kept = len(old & new)
        summary[rank].heads_discarded = len(old - new)
    return SwitchManifest(src, dst, weights, kv, placed.new_tables, owners, placed.dropped,
                          summary, placed.placed, release=placed.release)
