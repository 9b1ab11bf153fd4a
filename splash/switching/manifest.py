"""Switch manifests derived from the ownership model (DESIGN §3, paper §4.1).

For every rank the manifest says which projection heads and which KV pages it keeps, repacks
(kept, new local index), discards, and receives — and from whom. Nothing here knows the twelve
directions by name: each page's holders and each rank's heads under the source and destination
layouts are compared, and the difference is what moves. Pure CPU; no device tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from splash.core.allocator import RankAllocators
from splash.core.ownership import (
    KVPlacement,
    Layout,
    heads_held,
    local_page_index,
    page_holders,
)
from splash.core.prefix_cache import CachedHistory
from splash.core.protocol import KVMove, WeightMove
from splash.core.request import Request

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
    allocated: list[list[int]]  # per rank: pages taken for received rows
    discard: list[list[int]]  # per rank: requests' page references dropped once the step is done
    summary: list[RankSummary] = field(default_factory=list)
    placed: dict[tuple[str, int, int], int] = field(default_factory=dict)  # moved-into pages
    #   of requests, one reference each (a page shared by k requests is placed k times)
    cached: list[CachedHistory] = field(default_factory=list)  # cached chains moved along
    release: list[list[int]] = field(default_factory=list)  # per rank: references held for
    #   the step only (cached chains' pages, received pages no request holds)

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

    def give_back(self, allocators: RankAllocators) -> None:
        """Drop every page reference building this manifest took (it will not be carried
        out). Only for a manifest built without staged pages."""
        for rank, pages in enumerate(self.release):
            allocators[rank].free(pages)
        for (_, _, rank), page in self.placed.items():
            allocators[rank].free([page])

    def predicted_bytes(self, kv_row_bytes: int, head_bytes: int, num_layers: int) -> dict:
        """Bytes each rank receives over the whole switch (all layers)."""
        kv = [s.kv_rows_received * kv_row_bytes * num_layers for s in self.summary]
        w = [s.heads_received * head_bytes * num_layers for s in self.summary]
        return {"kv_bytes_received": kv, "weight_bytes_received": w}


def _balanced_owners(histories: list[History], world: int) -> dict[str, int]:
    """Largest history first onto the least-loaded rank (owners balanced by live KV tokens);
    cached chains are balanced among themselves. Requests sharing pages may land on different
    owners: each then holds its own copy (balance first)."""
    owners: dict[str, int] = {}
    requests: list[History] = [h for h in histories if not isinstance(h, CachedHistory)]
    chains: list[History] = [h for h in histories if isinstance(h, CachedHistory)]
    for part in (requests, chains):
        load = [0] * world
        for h in sorted(part, key=lambda h: (-h.num_computed, h.request_id)):
            rank = min(range(world), key=lambda r: (load[r], r))
            owners[h.request_id] = rank
            load[rank] += h.num_computed
    return owners


def _weight_moves(src: Layout, dst: Layout, world: int, num_heads: int) -> list[WeightMove]:
    held_src = [set(heads_held(src, r, world, num_heads)) for r in range(world)]
    moves = []
    for rank in range(world):
        need = heads_held(dst, rank, world, num_heads)
        recv: list[list[int]] = [[] for _ in range(world)]
        send: list[list[int]] = [[] for _ in range(world)]
        for h in need:
            if h not in held_src[rank]:
                recv[min(r for r in range(world) if h in held_src[r])].append(h)
        for d in range(world):
            for h in heads_held(dst, d, world, num_heads):
                if h not in held_src[d] and min(r for r in range(world) if h in held_src[r]) == rank:
                    send[d].append(h)
        moves.append(WeightMove(need.start, need.stop, recv, send))
    return moves


PageKey = tuple[str, int, int]  # (request id, logical page, destination rank)


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
    not fit — the caller defers the switch.

    A background switch calls it twice. The pre-copy moves each request's rows [0, n) as they
    are when it starts; the handoff moves only the rows written since (``rows_from``: rows
    already moved per request, absent = 0) into the pages the pre-copy placed (``staged``),
    with the pre-copy's ``owners``. A page a destination rank already holds under ``src`` is
    kept and never moves; a full page several requests share moves once.

    ``cached`` chains (unreferenced cached pages, pinned here for the step) move along when
    their pages fit beside the requests'; otherwise they stay where they are."""
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
    if owners is None:
        owners = {h.request_id: h.owner for h in histories}
        if dst.uses_owners and not src.uses_owners:
            owners = _balanced_owners(histories, world)
    else:
        fresh_hist = [h for h in histories if h.request_id not in owners]
        if fresh_hist:  # admitted during a pre-copy: placed by the destination's rules
            owners = dict(owners)
            extra = _balanced_owners(fresh_hist, world) if dst.uses_owners and \
                not src.uses_owners else {h.request_id: h.owner for h in fresh_hist}
            owners.update(extra)
    rows_from = rows_from or {}
    staged = staged or {}
    summary = [RankSummary() for _ in range(world)]
    need = [0] * world
    # (history, logical page, dst rank, source (rank, page) or None, kept or staged page,
    # fresh slot: index into this rank's fresh pages or -1)
    plans: list[tuple[History, int, int, tuple[int, int] | None, int, int]] = []
    moved: dict[tuple[int, int, int], int] = {}  # full (src rank, src page, dst rank) -> slot
    for h in histories:
        n_pages = -(-h.num_computed // page_size)
        for i in range(n_pages):
            src_h = page_holders(src, i, h.owner, world)
            dst_h = page_holders(dst, i, owners[h.request_id], world)
            for d in dst_h:
                if d in src_h:
                    plans.append((h, i, d, None, h.tables[d][local_page_index(src, i, world)],
                                  -1))
                    continue
                s = src_h[0]
                src_page = h.tables[s][local_page_index(src, i, world)]
                page = staged.get((h.request_id, i, d), -1)
                slot = -1
                if page < 0:
                    # a full page (immutable) shared by k histories moves once; a partly
                    # filled one is copied per history (its sharers write different rows next)
                    key = (s, src_page, d) if h.num_computed >= (i + 1) * page_size else None
                    if key is not None and key in moved:
                        slot = moved[key]
                    else:
                        slot = need[d]
                        need[d] += 1
                        if key is not None:
                            moved[key] = slot
                plans.append((h, i, d, (s, src_page), page, slot))
    if not allocators.can_allocate(need):
        return None
    fresh = allocators.allocate(need)
    allocated = [list(p) for p in fresh]
    users = [[0] * len(f) for f in fresh]  # requests holding each fresh page
    send: list[list[list[int]]] = [[[] for _ in range(world)] for _ in range(world)]
    recv: list[list[list[int]]] = [[[] for _ in range(world)] for _ in range(world)]
    new_tables: dict[str, list[list[int]]] = {}
    placed: dict[PageKey, int] = {}
    kept: list[set[int]] = [set() for _ in range(world)]
    filled: set[tuple[int, int]] = set()  # (dst rank, fresh slot) whose rows are on their way
    for h, i, d, source, page, slot in plans:
        table = new_tables.setdefault(h.request_id, [[] for _ in range(world)])
        is_request = not isinstance(h, CachedHistory)
        if source is None:
            if page not in kept[d]:
                kept[d].add(page)
                summary[d].pages_kept += 1
                if local_page_index(src, i, world) != local_page_index(dst, i, world):
                    summary[d].pages_repacked += 1
        else:
            s, src_page = source
            lo = max(rows_from.get(h.request_id, 0) - i * page_size, 0)
            if page < 0:
                page = fresh[d][slot]
                users[d][slot] += is_request
                if (d, slot) in filled:
                    lo = page_size  # another history sends this shared page
                else:
                    filled.add((d, slot))
                    summary[d].pages_received += 1
            if is_request:
                placed[(h.request_id, i, d)] = page
            hi = min(page_size, h.num_computed - i * page_size)
            if hi > lo:
                send[s][d] += [src_page * page_size + lo, hi - lo]
                recv[d][s] += [page * page_size + lo, hi - lo]
                summary[d].kv_rows_received += hi - lo
                summary[s].kv_rows_sent += hi - lo
        table[d].append(page)  # logical pages visited in order, so local order holds
    # a fresh page starts with one reference: one more per further request holding it, and
    # none kept for pages only cached chains hold (released after the step)
    release: list[list[int]] = [[] for _ in range(world)]
    for d in range(world):
        for slot, page in enumerate(fresh[d]):
            if users[d][slot] == 0:
                release[d].append(page)
            elif users[d][slot] > 1:
                allocators[d].incref([page] * (users[d][slot] - 1))
    discard: list[list[int]] = [[] for _ in range(world)]
    for h in histories:
        if isinstance(h, CachedHistory):
            continue
        for rank, pages in enumerate(h.tables):  # references the request no longer holds
            keep = set(new_tables.get(h.request_id, [[]] * world)[rank])
            discard[rank].extend(p for p in pages if p not in keep)
    for rank in range(world):
        summary[rank].pages_discarded = len(set(discard[rank]) - kept[rank])
    weights = _weight_moves(src, dst, world, num_heads)
    for rank, mv in enumerate(weights):
        old = heads_held(src, rank, world, num_heads)
        new = range(mv.head_start, mv.head_stop)
        summary[rank].heads_received = sum(len(x) for x in mv.recv_from)
        summary[rank].heads_kept = len(set(old) & set(new))
        summary[rank].heads_discarded = len(set(old) - set(new))
    kv = [KVMove(send[r], recv[r]) for r in range(world)]
    return SwitchManifest(src, dst, weights, kv, new_tables, owners, allocated, discard, summary,
                          placed, release=release)
