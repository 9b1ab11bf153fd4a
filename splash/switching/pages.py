"""Where every KV page of a switch goes, answered for all pages at once with numpy.

The KV part of a switch is one question asked of every logical page of every history (a
running request or an unreferenced cached chain): which ranks hold it under the destination
(`ownership.holders`), which of them hold it already under the source (kept in place), and for
the others, which source holder it is copied from (the lowest), which rows move and into which
page. The pages of all histories are laid out end to end (history by history, logical page by
logical page) and the per-rank answers are (pages, world) matrices, so planning costs a fixed
number of array operations whatever the context; only what is handed on (block tables, runs of
slots, dropped pages) becomes Python lists, and a table that exists already as a list (kept
whole, or all fresh pages) is sliced rather than rebuilt. An *entry* is one (page, rank) cell
of those matrices, numbered ``page * world + rank``; received entries are listed rank by rank,
in entry order on each rank — the order their fresh pages are allocated in and, per pair of
ranks, the order of the runs between them.

Pages are shared (reference counted): a full page several histories hold is received once per
destination rank and the later histories share that copy (a partly filled one is copied per
holder: they write different rows next). A handoff passes the pages its pre-copy placed
(``staged``, per history a (pages, world) array, -1 where nothing was placed) and the rows
already moved (``rows_from``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from itertools import chain

import numpy as np

from splash.core.allocator import RankAllocators
from splash.core.ownership import Layout, holders, local_page_index
from splash.core.prefix_cache import CachedHistory
from splash.core.request import Request

History = Request | CachedHistory  # a request's pages, or an unreferenced cached chain
Placed = dict[str, np.ndarray]  # history -> (pages, world) received pages, -1 where none
INDEX = np.int32  # pages, slots and positions (half the memory of int64: planning is
#   bound by the arrays it allocates)


@dataclass
class PagePlan:
    """Every destination page of every history, before fresh pages are allocated. Pages (N)
    are numbered history by history; entries (page * world + rank) are (N, world) cells."""

    world: int
    page_size: int
    histories: list[History]
    is_request: np.ndarray  # (H,) False for cached chains
    num_pages: np.ndarray  # (H,) logical pages of each history
    starts: np.ndarray  # (H + 1,) each history's first page
    hist: np.ndarray  # (N,) each page's history
    src_local: np.ndarray  # (N,) each page's local index under the source
    repacked: np.ndarray  # (N,) whether that index changes under the destination
    held: np.ndarray  # (N, world) the destination holders of each page
    kept_mask: np.ndarray  # (N, world) those that hold it under the source too: kept
    src_count: np.ndarray  # (world, H) pages each rank holds of each history under the source
    held_count: np.ndarray  # (world, H) ... and under the destination
    kept_count: np.ndarray  # (world, H) of them, those kept
    in_place: np.ndarray  # (world, H) of those, the ones whose local index stays
    tables: np.ndarray  # source block tables: every history's on rank 0, then on rank 1, ...
    table_lens: np.ndarray  # (world, H) their lengths
    canon: np.ndarray | None  # (L,) the first table entry holding each entry's (rank, page);
    #   None when no page is in two entries (then nothing is shared, nothing counts twice)
    recv: np.ndarray  # (R,) entries received, rank by rank, in entry order on each rank
    recv_page: np.ndarray  # (R,) their page
    recv_rank: np.ndarray  # (R,) their rank
    source: np.ndarray  # (R,) the source holder each is copied from
    source_page: np.ndarray  # (R,) its page there
    rows_start: np.ndarray | None  # (R,) first row to move (offset in the page); None: 0
    rows: np.ndarray  # (R,) rows to move (0 for a shared page)
    page: np.ndarray  # (R,) its staged page, or -1 (a fresh one, or its receiver's if shared)
    share_of: np.ndarray | None  # (R,) the entry whose copy it holds (itself if not shared);
    #   None when no entry shares
    fresh: np.ndarray  # received entries that need a fresh page (in ``recv``'s order)
    reused: np.ndarray  # received entries whose content the receiver has cached: that page
    #   is taken (one more reference) and no row moves

    def reused_pages(self) -> list[list[int]]:
        """Per rank, the cached pages the reused entries take (one reference each)."""
        rank, page = self.recv_rank[self.reused], self.page[self.reused]
        return [page[rank == r].tolist() for r in range(self.world)]

    @cached_property
    def kept(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The kept entries (K,), their rank and their page's index in ``tables`` (only
        tables that are neither kept whole nor dropped whole need them)."""
        kept = np.flatnonzero(self.kept_mask)
        page, rank = np.divmod(kept, self.world)
        at = np.cumsum(self.table_lens) - self.table_lens.ravel()
        return kept, rank, at[rank * len(self.histories) + self.hist[page]] + self.src_local[page]


@dataclass
class PagePlacement:
    """The destination tables and the row moves, once received pages have their pages."""

    new_tables: dict[str, list[list[int]]]  # history -> per-rank local block tables
    send: list[list[list[int]]]  # [src][dst]: runs (first slot, rows) src sends to dst
    recv: list[list[list[int]]]  # [dst][src]: runs dst writes, in the same order
    placed: Placed  # requests' received pages (a page k requests share is placed k times)
    dropped: list[list[int]]  # per rank: requests' references to pages they no longer hold
    release: list[list[int]]  # per rank: fresh pages only cached chains hold
    incref: list[list[int]]  # per rank: further references to fresh pages requests share
    counts: dict[str, np.ndarray]  # per-rank page and row figures (RankSummary's names)


def plan_pages(src: Layout, dst: Layout, histories: list[History], owners: dict[str, int],
               world: int, page_size: int, pool_pages: int,
               rows_from: dict[str, int] | None = None,
               staged: Placed | None = None,
               lookup: Callable[[int, list[bytes]], list[int]] | None = None) -> PagePlan:
    """Every destination page: kept where the source already holds it on that rank, else
    received from its lowest source holder — its rows from ``rows_from`` (rows already moved
    per history) on, into its ``staged`` page if any. A full page of a request whose key the
    receiving rank has cached (``lookup(rank, keys)``: each key's cached page or -1, from the
    prefix cache, e.g. the copy an earlier switch left there) takes that page and moves
    nothing. A full page an earlier entry
    already receives from the same source page onto the same rank shares that copy.
    ``pool_pages``: pages in a rank's pool."""
    num = len(histories)
    computed = np.fromiter((h.num_computed for h in histories), INDEX, num)
    own_src = np.fromiter((h.owner for h in histories), INDEX, num)
    own_dst = np.fromiter((owners[h.request_id] for h in histories), INDEX, num)
    n = -(-computed // page_size)
    starts = np.zeros(num + 1, INDEX)
    np.cumsum(n, out=starts[1:])
    hist = np.repeat(np.arange(num, dtype=INDEX), n)  # (N,)
    logical = np.arange(len(hist), dtype=INDEX)
    logical -= starts[hist]
    held_src = holders(src, logical, own_src[hist], world)  # (N, world)
    held = holders(dst, logical, own_dst[hist], world)
    src_local = local_page_index(src, logical, world)
    repacked = src_local != local_page_index(dst, logical, world)
    kept_mask = held & held_src
    need, held_count, kept_count, in_place = _per_history(
        [held_src, held, kept_mask, kept_mask & ~repacked[:, None]], starts)
    tables, lens = _source_tables(src, histories, need, world)
    canon = _canon(tables, lens, pool_pages)

    recv_rank, rp = np.divmod(np.flatnonzero((held > held_src).T), len(hist))
    recv = rp * world + recv_rank
    first = held_src.argmax(axis=1)  # the first True: the lowest source holder
    at = (np.cumsum(lens) - lens.ravel())[first * num + hist] + src_local  # its table entry
    at, source = at[rp], first[rp]
    source_page = tables[at]
    first_row = logical[rp] * page_size
    rows = np.minimum(computed[hist[rp]] - first_row, page_size)  # the rows it holds
    full = rows == page_size
    rows_start = None
    if rows_from:
        done = np.fromiter((rows_from.get(h.request_id, 0) for h in histories), INDEX, num)
        rows_start = np.maximum(done[hist[rp]] - first_row, 0)
        rows = np.maximum(rows - rows_start, 0)
    page = (_staged(staged, histories, starts, world)[recv] if staged
            else np.full(len(recv), -1, INDEX))
    is_request = np.fromiter((not isinstance(h, CachedHistory) for h in histories), bool, num)
    reused = np.zeros(0, INDEX)
    if lookup is not None:
        hit = _cache_hits(histories, hist[rp], logical[rp], recv_rank,
                          full & (page < 0) & is_request[hist[rp]], lookup)
        reused = np.flatnonzero(hit >= 0).astype(INDEX)
        page[reused], rows[reused] = hit[reused], 0
    share_of = None
    if canon is not None:  # only a full page two table entries hold is shared
        copy = canon[at]  # the source page, as its first table entry
        many = np.bincount(canon, minlength=len(canon))[copy] > 1
        cand = np.flatnonzero(many & full & (page < 0))
        share_of = np.arange(len(recv), dtype=INDEX)
        share_of[cand] = cand[_first(copy[cand] * world + recv_rank[cand], len(canon) * world)]
        shared = share_of != np.arange(len(recv))
        rows[shared] = 0
        share_of = share_of if shared.any() else None
    fresh = np.flatnonzero(page < 0) if staged or len(reused) \
        else np.arange(len(recv), dtype=INDEX)
    if share_of is not None:
        fresh = fresh[share_of[fresh] == fresh]
    return PagePlan(world, page_size, histories, is_request, n, starts, hist, src_local,
                    repacked, held, kept_mask, need, held_count, kept_count, in_place, tables,
                    lens, canon, recv, rp, recv_rank, source, source_page, rows_start, rows,
                    page, share_of, fresh, reused)


def _cache_hits(histories: list[History], hist: np.ndarray, logical: np.ndarray,
                rank: np.ndarray, candidate: np.ndarray,
                lookup: Callable[[int, list[bytes]], list[int]]) -> np.ndarray:
    """(R,) for each received entry the page its receiver has cached under the page's key, or
    -1 (only ``candidate`` entries with a key are looked up: full pages of requests)."""
    out = np.full(len(rank), -1, INDEX)
    keyed = np.fromiter((len(h.block_hashes) for h in histories), INDEX, len(histories))
    candidate = candidate & (logical < keyed[hist])
    for r in np.unique(rank[candidate]).tolist():
        at = np.flatnonzero(candidate & (rank == r))
        keys = [histories[h].block_hashes[i] for h, i in zip(hist[at].tolist(),
                                                             logical[at].tolist())]
        out[at] = lookup(r, keys)
    return out


def received_pages(plan: PagePlan) -> list[int]:
    """Fresh pages each rank needs for the pages it receives (staged ones have theirs)."""
    return np.bincount(plan.recv_rank[plan.fresh], minlength=plan.world).tolist()


def place_pages(plan: PagePlan, fresh: list[list[int]]) -> PagePlacement:
    """Destination tables (kept, staged and ``fresh`` pages, in logical order), the runs of
    slots each received page's rows move between (one run per page), the pages requests drop,
    and the references the fresh pages need beyond the one allocation gave them."""
    world = plan.world
    page = plan.page.copy()
    page[plan.fresh] = np.fromiter(chain.from_iterable(fresh), INDEX, len(plan.fresh))
    if plan.share_of is not None:
        page = page[plan.share_of]
    placed_at = np.full(plan.held.size, -1, INDEX)
    if plan.is_request.all():
        by_request = np.ones(len(page), bool)
        placed_at[plan.recv] = page
    else:
        by_request = plan.is_request[plan.hist[plan.recv_page]]
        placed_at[plan.recv[by_request]] = page[by_request]
    by_page = placed_at.reshape(-1, world)
    placed = {h.request_id: by_page[a:b] for h, a, b, req in zip(
        plan.histories, plan.starts[:-1], plan.starts[1:], plan.is_request) if req}
    send, recv, pair_rows = _runs(plan, page)
    dropped, counts = _dropped(plan)
    counts["pages_received"] = np.array([len(pages) for pages in fresh])
    counts["pages_reused"] = np.bincount(plan.recv_rank[plan.reused], minlength=world)
    counts["kv_rows_received"] = pair_rows.sum(0)
    counts["kv_rows_sent"] = pair_rows.sum(1)
    return PagePlacement(_new_tables(plan, page, fresh), send, recv, placed, dropped,
                         *_references(plan, page, by_request), counts)


def free_placed(placed: Placed, allocators: RankAllocators,
                keep: set[str] | frozenset[str] = frozenset()) -> None:
    """Drop the references the placed pages of histories not in ``keep`` hold."""
    arrays = [pages for rid, pages in placed.items() if rid not in keep]
    if not arrays:
        return
    pages = np.concatenate(arrays)  # (pages, world)
    for rank in range(pages.shape[1]):
        col = pages[:, rank]
        allocators[rank].free(col[col >= 0][::-1].tolist())  # back to the pool in page order


def _per_history(masks: list[np.ndarray], starts: np.ndarray) -> np.ndarray:
    """(N, world) flags each -> (world, H) each: how many of each history's pages are raised
    per rank."""
    out = np.zeros((len(masks), len(starts) - 1, masks[0].shape[1]), INDEX)
    some = np.flatnonzero(np.diff(starts))  # reduceat needs non-empty segments
    if len(some):
        flags = np.stack(masks).view(np.uint8)  # (masks, N, world)
        out[:, some] = np.add.reduceat(flags, starts[some], axis=1, dtype=INDEX)
    return out.transpose(0, 2, 1)


def _source_tables(src: Layout, histories: list[History], need: np.ndarray,
                   world: int) -> tuple[np.ndarray, np.ndarray]:
    """Every history's block tables, flattened rank by rank, and their lengths (world, H);
    ``need``: the pages each rank holds of each history under ``src`` (world, H)."""
    lens = np.array([[len(h.tables[r]) for h in histories] for r in range(world)],
                    INDEX).reshape(need.shape)
    short = lens < need
    if short.any():
        r, h = (int(x[0]) for x in np.nonzero(short))
        raise ValueError(f"history {histories[h].request_id!r} holds {lens[r, h]} pages on "
                         f"rank {r} under {src.name}, fewer than its length needs "
                         f"({need[r, h]})")
    tables = np.fromiter(chain.from_iterable(h.tables[r] for r in range(world)
                                             for h in histories), INDEX, int(lens.sum()))
    return tables, lens


def _canon(tables: np.ndarray, lens: np.ndarray, pool_pages: int) -> np.ndarray | None:
    """For each table entry, the first entry holding the same (rank, page); None when every
    page is in one entry."""
    key = np.repeat(np.arange(len(lens), dtype=INDEX) * pool_pages, lens.sum(1)) + tables
    seen = np.zeros(len(lens) * pool_pages, bool)
    seen[key] = True
    return None if np.count_nonzero(seen) == len(key) else _first(key, len(seen))


def _first(keys: np.ndarray, size: int) -> np.ndarray:
    """For each entry, the index of the first entry with its key (keys in [0, size))."""
    first = np.full(size, len(keys), INDEX)
    np.minimum.at(first, keys, np.arange(len(keys), dtype=INDEX))
    return first[keys]


def _staged(staged: Placed, histories: list[History], starts: np.ndarray,
            world: int) -> np.ndarray:
    """The pre-copy's pages laid out like the entries (-1 where it placed none)."""
    out = np.full((starts[-1], world), -1, INDEX)
    for h, hist in enumerate(histories):
        pages = staged.get(hist.request_id)
        if pages is not None:
            k = min(len(pages), starts[h + 1] - starts[h])
            out[starts[h]:starts[h] + k] = pages[:k]
    return out.ravel()


def _new_tables(plan: PagePlan, page: np.ndarray, fresh: list[list[int]]
                ) -> dict[str, list[list[int]]]:
    """Per history, per rank: the pages it holds, in logical order. A table the rank keeps
    whole and in place, or one of fresh pages only, is a slice of a list already there."""
    world, hists, num = plan.world, plan.histories, len(plan.histories)
    if len(plan.fresh) == len(plan.recv):  # every received page is fresh
        n_fresh = (plan.held_count - plan.kept_count).tolist()
    else:
        fi = plan.fresh
        n_fresh = np.bincount(plan.recv_rank[fi] * num + plan.hist[plan.recv_page[fi]],
                              minlength=world * num).reshape(world, num).tolist()
    held, in_place = plan.held_count.tolist(), plan.in_place.tolist()
    final = None
    out: list[list[list[int]]] = [[] for _ in hists]
    for r in range(world):
        used = 0  # fresh pages of rank r taken by earlier histories
        column: list[int] | None = None
        for h, hist in enumerate(hists):
            m, f = held[r][h], n_fresh[r][h]
            if in_place[r][h] == m:
                out[h].append(hist.tables[r][:m])
            elif f == m:
                out[h].append(fresh[r][used:used + m])
            else:
                if final is None:
                    kept, _, index = plan.kept
                    final = np.full(plan.held.shape, -1, INDEX)
                    final.ravel()[kept] = plan.tables[index]
                    final.ravel()[plan.recv] = page
                if column is None:  # rank r's pages of every history, in order
                    col = final[:, r] if sum(held[r]) == len(final) else final[plan.held[:, r], r]
                    column, at = col.tolist(), [0, *np.cumsum(held[r]).tolist()]
                out[h].append(column[at[h]:at[h + 1]])
            used += f
    return {h.request_id: t for h, t, n in zip(hists, out, plan.num_pages.tolist()) if n}


def _runs(plan: PagePlan, page: np.ndarray) -> tuple[list, list, np.ndarray]:
    """The runs of slots received rows move between, per (source, destination) pair, in
    entry order; the rows each pair moves, (world, world)."""
    world, ps = plan.world, plan.page_size
    moved = np.flatnonzero(plan.rows) if not plan.rows.all() else None
    pair = plan.source * world + plan.recv_rank
    if moved is not None:
        pair = pair[moved]
    order = np.argsort(pair.astype(np.int16), kind="stable")  # world**2 < 2**15
    if moved is not None:
        order = moved[order]
    ends = np.zeros(world * world + 1, np.int64)
    np.cumsum(np.bincount(pair, minlength=world * world), out=ends[1:])
    bounds = (2 * ends).tolist()
    rows = plan.rows[order]
    pair_rows = np.diff(np.concatenate(([0], np.cumsum(rows)))[ends]).reshape(world, world)
    send_slot, recv_slot = plan.source_page[order] * ps, page[order] * ps
    if plan.rows_start is not None:
        send_slot += plan.rows_start[order]
        recv_slot += plan.rows_start[order]
    send_flat = np.stack([send_slot, rows], 1).ravel().tolist()
    recv_flat = np.stack([recv_slot, rows], 1).ravel().tolist()
    send = [[send_flat[bounds[s * world + d]:bounds[s * world + d + 1]] for d in range(world)]
            for s in range(world)]
    recv = [[recv_flat[bounds[s * world + d]:bounds[s * world + d + 1]] for s in range(world)]
            for d in range(world)]
    return send, recv, pair_rows


def _references(plan: PagePlan, page: np.ndarray, by_request: np.ndarray
                ) -> tuple[list[list[int]], list[list[int]]]:
    """A fresh page starts with one reference: one more per further request holding it, and
    none kept for pages only cached chains hold (released after the step)."""
    world = plan.world
    release: list[list[int]] = [[] for _ in range(world)]
    incref: list[list[int]] = [[] for _ in range(world)]
    if plan.share_of is None and by_request.all():
        return release, incref  # every fresh page has the one request that receives it
    # requests' entries on each fresh page: the entries sharing it, the receiver included
    users = np.zeros(len(page), np.int64)
    holder = plan.share_of if plan.share_of is not None else np.arange(len(page))
    np.add.at(users, holder[(plan.page < 0) & by_request], 1)
    fresh = plan.fresh
    n, rank, pages = users[fresh], plan.recv_rank[fresh], page[fresh]
    for r in range(world):
        mine = rank == r
        release[r] = pages[mine & (n == 0)].tolist()
        incref[r] = np.repeat(pages[mine], np.maximum(n[mine] - 1, 0)).tolist()
    return release, incref


def _dropped(plan: PagePlan) -> tuple[list[list[int]], dict[str, np.ndarray]]:
    """Per rank, the requests' references to pages they do not hold under the destination (a
    page stays held when another history keeps it); the kept and discarded page counts."""
    world, lens, num = plan.world, plan.table_lens, len(plan.histories)
    kept_count, src_count, table_lens = plan.kept_count.tolist(), plan.src_count.tolist(), \
        lens.tolist()
    is_request = plan.is_request.tolist()
    at = (np.cumsum(lens) - lens.ravel()).tolist()
    drop = None
    dropped: list[list[int]] = [[] for _ in range(world)]
    for r in range(world):
        for h, hist in enumerate(plan.histories):
            k, n = kept_count[r][h], table_lens[r][h]
            if k == n or not is_request[h]:
                continue
            if k == 0:  # nothing kept: the whole table
                dropped[r] += hist.tables[r]
                continue
            if k == src_count[r][h]:  # all it held kept: the pages beyond (taken ahead)
                dropped[r] += hist.tables[r][k:]
                continue
            if drop is None:
                drop = np.ones(len(plan.tables), bool)
                drop[plan.kept[2]] = False
            a = at[r * num + h]
            dropped[r] += plan.tables[a:a + n][drop[a:a + n]].tolist()
    if plan.canon is None:  # no page in two table entries: none counts twice
        return dropped, {"pages_kept": plan.kept_count.sum(1),
                         "pages_repacked": (plan.kept_count - plan.in_place).sum(1),
                         "pages_discarded": np.array([len(d) for d in dropped])}
    kept, kept_rank, index = plan.kept  # pages as their first table entry from here on
    first = _first(plan.canon[index], len(plan.canon)) == np.arange(len(kept))  # counted once
    repacked = plan.repacked[kept[first] // world]
    if drop is None:
        drop = np.ones(len(plan.tables), bool)
        drop[index] = False
    drop &= np.repeat(np.tile(plan.is_request, world), lens.ravel())  # requests' entries
    marks = np.zeros(len(plan.canon), bool)
    marks[plan.canon[drop]] = True
    marks[plan.canon[index]] = False
    rank = np.repeat(np.arange(world), lens.sum(1))
    return dropped, {"pages_kept": np.bincount(kept_rank[first], minlength=world),
                     "pages_repacked": np.bincount(kept_rank[first][repacked], minlength=world),
                     "pages_discarded": np.bincount(rank[marks], minlength=world)}
