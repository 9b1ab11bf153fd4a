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
from splash.core.protocol import KVMove, WeightMove
from splash.core.request import Request


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
    new_tables: dict[str, list[list[int]]]  # request -> per-rank local block tables
    new_owners: dict[str, int]
    allocated: list[list[int]]  # per rank: pages taken for received rows
    discard: list[list[int]]  # per rank: pages freed once the switch step is done
    summary: list[RankSummary] = field(default_factory=list)
    placed: dict[tuple[str, int, int], int] = field(default_factory=dict)  # moved-into pages

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


def _balanced_owners(requests: list[Request], world: int) -> dict[str, int]:
    """Largest history first onto the least-loaded rank (owners balanced by live KV tokens)."""
    load = [0] * world
    owners: dict[str, int] = {}
    for req in sorted(requests, key=lambda r: (-r.num_computed, r.request_id)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[req.request_id] = rank
        load[rank] += req.num_computed
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
) -> SwitchManifest | None:
    """The manifest for switching ``requests`` (with their current tables) from ``src`` to
    ``dst``, allocating destination pages; None (nothing allocated) when the pages needed do
    not fit — the caller defers the switch.

    A background switch calls it twice. The pre-copy moves each request's rows [0, n) as they
    are when it starts; the handoff moves only the rows written since (``rows_from``: rows
    already moved per request, absent = 0) into the pages the pre-copy placed (``staged``),
    with the pre-copy's ``owners``. A page a destination rank already holds under ``src`` is
    kept and never moves."""
    if owners is None:
        owners = {r.request_id: r.owner for r in requests}
        if dst.uses_owners and not src.uses_owners:
            owners = _balanced_owners(requests, world)
    else:
        fresh_reqs = [r for r in requests if r.request_id not in owners]
        if fresh_reqs:  # admitted during a pre-copy: placed by the destination's rules
            owners = dict(owners)
            extra = _balanced_owners(fresh_reqs, world) if dst.uses_owners and \
                not src.uses_owners else {r.request_id: r.owner for r in fresh_reqs}
            owners.update(extra)
    rows_from = rows_from or {}
    staged = staged or {}
    summary = [RankSummary() for _ in range(world)]
    need = [0] * world
    # (req, logical page, dst rank, source (rank, page) or None, kept or staged page)
    plans: list[tuple[Request, int, int, tuple[int, int] | None, int]] = []
    for req in requests:
        n_pages = -(-req.num_computed // page_size)
        for i in range(n_pages):
            src_h = page_holders(src, i, req.owner, world)
            dst_h = page_holders(dst, i, owners[req.request_id], world)
            for d in dst_h:
                if d in src_h:
                    plans.append((req, i, d, None, req.tables[d][local_page_index(src, i, world)]))
                    continue
                s = src_h[0]
                page = staged.get((req.request_id, i, d), -1)
                plans.append((req, i, d, (s, req.tables[s][local_page_index(src, i, world)]),
                              page))
                need[d] += page < 0
    if not allocators.can_allocate(need):
        return None
    fresh = allocators.allocate(need)
    allocated = [list(p) for p in fresh]
    send: list[list[list[int]]] = [[[] for _ in range(world)] for _ in range(world)]
    recv: list[list[list[int]]] = [[[] for _ in range(world)] for _ in range(world)]
    new_tables: dict[str, list[list[int]]] = {}
    placed: dict[PageKey, int] = {}
    kept: list[set[int]] = [set() for _ in range(world)]
    for req, i, d, source, page in plans:
        table = new_tables.setdefault(req.request_id, [[] for _ in range(world)])
        if source is None:
            kept[d].add(page)
            summary[d].pages_kept += 1
            if local_page_index(src, i, world) != local_page_index(dst, i, world):
                summary[d].pages_repacked += 1
        else:
            s, src_page = source
            if page < 0:
                page = fresh[d].pop(0)
                summary[d].pages_received += 1
            placed[(req.request_id, i, d)] = page
            lo = max(rows_from.get(req.request_id, 0) - i * page_size, 0)
            hi = min(page_size, req.num_computed - i * page_size)
            if hi > lo:
                send[s][d] += [src_page * page_size + lo, hi - lo]
                recv[d][s] += [page * page_size + lo, hi - lo]
                summary[d].kv_rows_received += hi - lo
                summary[s].kv_rows_sent += hi - lo
        table[d].append(page)  # logical pages visited in order, so local order holds
    discard: list[list[int]] = [[] for _ in range(world)]
    for req in requests:
        for rank, pages in enumerate(req.tables):
            gone = [p for p in pages if p not in kept[rank]]
            discard[rank].extend(gone)
            summary[rank].pages_discarded += len(gone)
    weights = _weight_moves(src, dst, world, num_heads)
    for rank, mv in enumerate(weights):
        old = heads_held(src, rank, world, num_heads)
        new = range(mv.head_start, mv.head_stop)
        summary[rank].heads_received = sum(len(x) for x in mv.recv_from)
        summary[rank].heads_kept = len(set(old) & set(new))
        summary[rank].heads_discarded = len(set(old) - set(new))
    kv = [KVMove(send[r], recv[r]) for r in range(world)]
    return SwitchManifest(src, dst, weights, kv, new_tables, owners, allocated, discard, summary,
                          placed)
