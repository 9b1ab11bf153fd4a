"""Where every KV page of a switch goes, answered for all pages at once with numpy.

The KV part of a switch is one question asked of every logical page of every history (a
running request or an unreferenced cached chain): which ranks hold it under the destination
(`ownership.holds`), which of them hold it already under the source (kept in place), and for
the others, which source holder it is copied from (the lowest), which rows move and into which
page. The pages of all histories are laid out end to end (history by history, logical page by
logical page) and the per-rank answers are (pages, world) matrices, so planning costs a fixed
number of array operations whatever the context; only what is handed on (block tables, runs of
slots, dropped pages) becomes Python lists. An *entry* is one (page, rank) cell of those
matrices, numbered ``page * world + rank``: entries in numerical order are in (history, logical
page, rank) order, the order the runs between two ranks are listed in.

Pages are shared (reference counted): a full page several histories hold is received once per
destination rank and the later histories share that copy (a partly filled one is copied per
holder: they write different rows next). A handoff passes the pages its pre-copy placed
(``staged``, per history a (pages, world) array, -1 where nothing was placed) and the rows
already moved (``rows_from``).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np

from splash.core.allocator import RankAllocators
from splash.core.ownership import Layout, holds, local_page_index, num_local_pages
from splash.core.prefix_cache import CachedHistory
from splash.core.request import Request

History = Request | CachedHistory  # a request's pages, or an unreferenced cached chain
Placed = dict[str, np.ndarray]  # history -> (pages, world) received pages, -1 where none


@dataclass
class PagePlan:
    """Every destination page of every history, before fresh pages are allocated."""

    world: int
    page_size: int
    pool_pages: int  # pages in a rank's pool: (rank, page) keys are rank * pool_pages + page
    histories: list[History]
    is_request: np.ndarray  # (H,) False for cached chains
    starts: np.ndarray  # (H + 1,) flat index of each history's first page
    hist: np.ndarray  # (N,) each page's history
    held: np.ndarray  # (N, world) the destination holders of each page
    tables: np.ndarray  # source block tables: every history's on rank 0, then on rank 1, ...
    table_lens: np.ndarray  # (world, H) their lengths
    copies: np.ndarray  # (world * pool_pages,) table entries holding each (rank, page)
    kept: np.ndarray  # (K,) entries held under the source too: kept in place
    kept_index: np.ndarray  # (K,) each kept page's index in ``tables``
    repacked: np.ndarray  # (K,) bool: its local index changes
    recv: np.ndarray  # (R,) entries received
    source: np.ndarray  # (R,) the source holder each is copied from
    source_page: np.ndarray  # (R,) its page there
    rows_start: np.ndarray  # (R,) first row to move (offset in the page)
    rows: np.ndarray  # (R,) rows to move (0 for a shared page)
    page: np.ndarray  # (R,) its staged page, or -1 (a fresh one, or its receiver's if shared)
    share_of: np.ndarray  # (R,) the received entry whose copy it shares (itself if none)

    @property
    def fresh(self) -> np.ndarray:
        """Received entries that need a fresh page, in entry order."""
        return np.flatnonzero((self.page < 0) & (self.share_of == np.arange(len(self.recv))))


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
               staged: Placed | None = None) -> PagePlan:
    """Every destination page: kept where the source already holds it on that rank, else
    received from its lowest source holder — its rows from ``rows_from`` (rows already moved
    per history) on, into its ``staged`` page if any. A full page an earlier entry already
    receives from the same source page onto the same rank shares that copy."""
    num = len(histories)
    computed = np.fromiter((h.num_computed for h in histories), np.int64, num)
    done = np.fromiter(((rows_from or {}).get(h.request_id, 0) for h in histories), np.int64, num)
    own_src = np.fromiter((h.owner for h in histories), np.int64, num)
    own_dst = np.fromiter((owners[h.request_id] for h in histories), np.int64, num)
    n = -(-computed // page_size)
    starts = np.concatenate(([0], np.cumsum(n)))
    hist = np.repeat(np.arange(num), n)  # (N,)
    logical = np.arange(starts[-1]) - starts[hist]
    held_src = np.stack([holds(src, r, logical, own_src[hist], world) for r in range(world)], 1)
    held = np.stack([holds(dst, r, logical, own_dst[hist], world) for r in range(world)], 1)
    tables, lens = _source_tables(src, histories, n, own_src, world)
    table_start = (np.cumsum(lens) - lens.ravel()).reshape(lens.shape)
    table_rank = np.repeat(np.arange(world), lens.sum(1))
    copies = np.bincount(table_rank * pool_pages + tables, minlength=world * pool_pages)
    src_local = local_page_index(src, logical, world)

    kept = np.flatnonzero(held & held_src)
    kp, kr = np.divmod(kept, world)
    kept_index = table_start[kr, hist[kp]] + src_local[kp]
    repacked = src_local[kp] != local_page_index(dst, logical[kp], world)

    recv = np.flatnonzero(held & ~held_src)
    rp, rd = np.divmod(recv, world)
    source = held_src.argmax(axis=1)[rp]  # the first True: the lowest source holder
    source_page = tables[table_start[source, hist[rp]] + src_local[rp]]
    first_row = logical[rp] * page_size
    rows_start = np.maximum(done[hist[rp]] - first_row, 0)
    rows = np.maximum(np.minimum(page_size, computed[hist[rp]] - first_row) - rows_start, 0)
    page = (_staged(staged, histories, starts, world)[recv] if staged
            else np.full(len(recv), -1, np.int64))
    share_of = np.arange(len(recv))
    cand = np.flatnonzero((page < 0) & (computed[hist[rp]] >= first_row + page_size))
    copy = source[cand] * pool_pages + source_page[cand]  # a physical page; shareable only
    share_of[cand] = cand[_first(copy * world + rd[cand], copies[copy] > 1)]  # if 2+ hold it
    rows[share_of != np.arange(len(recv))] = 0
    is_request = np.fromiter((not isinstance(h, CachedHistory) for h in histories), bool, num)
    return PagePlan(world, page_size, pool_pages, histories, is_request, starts, hist, held,
                    tables, lens, copies, kept, kept_index, repacked, recv, source,
                    source_page, rows_start, rows, page, share_of)


def received_pages(plan: PagePlan) -> list[int]:
    """Fresh pages each rank needs for the pages it receives (staged ones have theirs)."""
    return np.bincount(plan.recv[plan.fresh] % plan.world, minlength=plan.world).tolist()


def place_pages(plan: PagePlan, fresh: list[list[int]]) -> PagePlacement:
    """Destination tables (kept, staged and ``fresh`` pages, in logical order), the runs of
    slots each received page's rows move between (one run per page), the pages requests drop,
    and the references the fresh pages need beyond the one allocation gave them."""
    world, ps = plan.world, plan.page_size
    rd = plan.recv % world
    fi = plan.fresh
    fi = fi[np.argsort(rd[fi].astype(np.int16), kind="stable")]  # rank by rank, entry order
    page = plan.page.copy()
    page[fi] = np.fromiter(chain.from_iterable(fresh), np.int64, len(fi))
    page = page[plan.share_of]
    final = np.full(plan.held.size, -1, np.int64)
    final[plan.kept] = plan.tables[plan.kept_index]
    final[plan.recv] = page
    placed_at = np.full(plan.held.size, -1, np.int64)
    by_request = plan.is_request[plan.hist[plan.recv // world]]
    placed_at[plan.recv[by_request]] = page[by_request]
    placed_at = placed_at.reshape(-1, world)
    placed = {h.request_id: placed_at[a:b] for h, a, b, req in zip(
        plan.histories, plan.starts[:-1], plan.starts[1:], plan.is_request) if req}
    send, recv = _runs(plan, page)
    release, incref = _references(plan, page, fi, by_request)
    dropped, counts = _dropped(plan)
    counts["pages_received"] = np.bincount(rd[fi], minlength=world)
    counts["kv_rows_received"] = np.bincount(rd, plan.rows, minlength=world).astype(np.int64)
    counts["kv_rows_sent"] = np.bincount(plan.source, plan.rows, minlength=world).astype(np.int64)
    return PagePlacement(_new_tables(plan, final.reshape(-1, world)), send, recv, placed,
                         dropped, release, incref, counts)


def free_placed(placed: Placed, allocators: RankAllocators, keep: set[str] | frozenset[str] = frozenset()
                ) -> None:
    """Drop the references the placed pages of histories not in ``keep`` hold."""
    arrays = [pages for rid, pages in placed.items() if rid not in keep]
    if not arrays:
        return
    pages = np.concatenate(arrays)  # (pages, world)
    for rank in range(pages.shape[1]):
        col = pages[:, rank]
        allocators[rank].free(col[col >= 0][::-1].tolist())  # back to the pool in page order


def _source_tables(src: Layout, histories: list[History], n: np.ndarray, owners: np.ndarray,
                   world: int) -> tuple[np.ndarray, np.ndarray]:
    """Every history's block tables, flattened rank by rank, and their lengths (world, H)."""
    lens = np.array([[len(h.tables[r]) for h in histories] for r in range(world)],
                    np.int64).reshape(world, len(histories))
    for r in range(world):
        need = np.asarray(num_local_pages(src, n, r, owners, world))
        short = np.flatnonzero(lens[r] < need)
        if len(short):
            h = int(short[0])
            raise ValueError(f"history {histories[h].request_id!r} holds {lens[r, h]} pages on "
                             f"rank {r} under {src.name}; its {n[h]} pages need {need[h]}")
    tables = np.fromiter(chain.from_iterable(h.tables[r] for r in range(world)
                                             for h in histories), np.int64, int(lens.sum()))
    return tables, lens


def _first(keys: np.ndarray, repeats: np.ndarray) -> np.ndarray:
    """For each entry, the index of the first entry with its key; only entries flagged in
    ``repeats`` may share a key (the others are their own first)."""
    first = np.arange(len(keys))
    idx = np.flatnonzero(repeats)
    if len(idx):
        _, at, inverse = np.unique(keys[idx], return_index=True, return_inverse=True)
        first[idx] = idx[at[inverse]]
    return first


def _staged(staged: Placed, histories: list[History], starts: np.ndarray,
            world: int) -> np.ndarray:
    """The pre-copy's pages laid out like the entries (-1 where it placed none)."""
    out = np.full((starts[-1], world), -1, np.int64)
    for h, hist in enumerate(histories):
        pages = staged.get(hist.request_id)
        if pages is not None:
            k = min(len(pages), starts[h + 1] - starts[h])
            out[starts[h]:starts[h] + k] = pages[:k]
    return out.ravel()


def _new_tables(plan: PagePlan, final: np.ndarray) -> dict[str, list[list[int]]]:
    """Per history, per rank: the pages of the entries it holds, in logical order."""
    tables: list[list[list[int]]] = [[] for _ in plan.histories]
    for r in range(plan.world):
        held = plan.held[:, r]
        pages = final[held, r].tolist()
        at = np.concatenate(([0], np.cumsum(held)))[plan.starts].tolist()
        for h, table in enumerate(tables):
            table.append(pages[at[h]:at[h + 1]])
    return {h.request_id: t for h, t, a, b in zip(plan.histories, tables, plan.starts[:-1],
                                                  plan.starts[1:]) if b > a}  # empty: none


def _runs(plan: PagePlan, page: np.ndarray) -> tuple[list, list]:
    """The runs of slots received rows move between, per (source, destination) pair, in
    entry order."""
    world, ps = plan.world, plan.page_size
    moved = np.flatnonzero(plan.rows > 0)
    pair = plan.source[moved] * world + plan.recv[moved] % world
    order = moved[np.argsort(pair.astype(np.int32), kind="stable")]
    bounds = (2 * np.concatenate(([0], np.cumsum(np.bincount(pair, minlength=world * world)))
                                 )).tolist()
    rows, start = plan.rows[order], plan.rows_start[order]
    send_flat = np.stack([plan.source_page[order] * ps + start, rows], 1).ravel().tolist()
    recv_flat = np.stack([page[order] * ps + start, rows], 1).ravel().tolist()
    send = [[send_flat[bounds[s * world + d]:bounds[s * world + d + 1]] for d in range(world)]
            for s in range(world)]
    recv = [[recv_flat[bounds[s * world + d]:bounds[s * world + d + 1]] for s in range(world)]
            for d in range(world)]
    return send, recv


def _references(plan: PagePlan, page: np.ndarray, fresh: np.ndarray, by_request: np.ndarray
                ) -> tuple[list[list[int]], list[list[int]]]:
    """A fresh page starts with one reference: one more per further request holding it, and
    none kept for pages only cached chains hold (released after the step)."""
    world, pool = plan.world, plan.pool_pages
    release: list[list[int]] = [[] for _ in range(world)]
    incref: list[list[int]] = [[] for _ in range(world)]
    shared = plan.share_of != np.arange(len(plan.recv))
    if not shared.any() and by_request.all():
        return release, incref  # every fresh page has the one request that receives it
    rd = plan.recv % world
    users = (plan.page < 0) & by_request  # requests' entries on fresh pages
    count = np.bincount(rd[users] * pool + page[users], minlength=world * pool)
    fresh_rank, fresh_page = rd[fresh], page[fresh]
    n = count[fresh_rank * pool + fresh_page]
    for r in range(world):
        mine = fresh_rank == r
        release[r] = fresh_page[mine & (n == 0)].tolist()
        incref[r] = np.repeat(fresh_page[mine], np.maximum(n[mine] - 1, 0)).tolist()
    return release, incref


def _dropped(plan: PagePlan) -> tuple[list[list[int]], dict[str, np.ndarray]]:
    """Per rank, the requests' references to pages they do not hold under the destination (a
    page stays held when another history keeps it); the kept and discarded page counts."""
    world, pool, lens = plan.world, plan.pool_pages, plan.table_lens
    rank = np.repeat(np.arange(world), lens.sum(1))
    drop = np.repeat(np.tile(plan.is_request, world), lens.ravel())  # requests' entries
    drop[plan.kept_index] = False
    kept_rank = rank[plan.kept_index]
    kept_key = kept_rank * pool + plan.tables[plan.kept_index]
    first = _first(kept_key, plan.copies[kept_key] > 1)
    first = first == np.arange(len(first))  # a shared page kept is counted once
    marks = np.zeros(world * pool, bool)
    marks[rank[drop] * pool + plan.tables[drop]] = True
    marks[kept_key] = False
    counts = {"pages_kept": np.bincount(kept_rank[first], minlength=world),
              "pages_repacked": np.bincount(kept_rank[first & plan.repacked], minlength=world),
              "pages_discarded": marks.reshape(world, pool).sum(1)}
    bounds = np.concatenate(([0], np.cumsum(lens.sum(1))))
    dropped = [plan.tables[a:b][drop[a:b]].tolist() for a, b in zip(bounds[:-1], bounds[1:])]
    return dropped, counts
