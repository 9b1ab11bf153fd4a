"""Switch manifests against a page-by-page oracle, on random states (no workers, milliseconds).

The oracle walks every logical page of every history with the page rule alone
(`ownership.page_holders`, `ownership.local_page_index`): which ranks hold it before and
after, which of them keep it, which source holders its rows may come from, and which full
pages several histories hold (they move once per destination rank). States are random:
worlds 2/4/8, all twelve directions, partial last pages, empty histories, requests sharing
full prefix pages, pages taken ahead of the computed rows, unreferenced cached chains, pools
too small for the move, and a background switch's handoff (a pre-copy, rows written since,
a request finished meanwhile, the delta into the staged pages)."""

from __future__ import annotations

import itertools
import random

import pytest

from splash.core.allocator import RankAllocators
from splash.core.ownership import LAYOUTS, local_page_index, page_holders
from splash.core.prefix_cache import CachedHistory
from splash.core.request import Request
from splash.sampling_params import SamplingParams
from splash.switching.manifest import build_manifest, destination_owners
from splash.switching.pages import free_placed

HEADS = 16
DIRECTIONS = list(itertools.permutations(LAYOUTS, 2))


def _holders(layout: str, page: int, owner: int, world: int) -> tuple[int, ...]:
    return page_holders(LAYOUTS[layout], page, owner, world)


def _local(layout: str, page: int, world: int) -> int:
    return local_page_index(LAYOUTS[layout], page, world)


def _state(rng: random.Random, src: str, world: int, ps: int, pool: int):
    """Requests and cached chains placed under ``src``; chains' pages cached, unreferenced."""
    alloc = RankAllocators(world, pool)
    reqs: list[Request] = []
    chains: list[CachedHistory] = []
    for j in range(rng.randint(1, 6) + rng.randint(0, 2)):
        chain = j >= 4 and rng.random() < 0.5
        owner = rng.randrange(world)
        rows = rng.choice([0, rng.randint(1, 3 * ps), rng.randint(2, 9) * ps, rng.randint(1, 12 * ps)])
        rows = rows // ps * ps if chain else rows
        n = -(-rows // ps)
        prefix: list[list[int]] = []  # per logical page: the pages of an earlier history
        others = [h for h in reqs + chains if src != "dp" and src != "dop" or h.owner == owner]
        if others and rng.random() < 0.6:
            other = rng.choice(others)
            full = min(other.num_computed, rows) // ps
            prefix = [[other.tables[r][_local(src, i, world)] if r in _holders(src, i, owner, world)
                       else -1 for r in range(world)] for i in range(rng.randint(0, full))]
        tables: list[list[int]] = [[] for _ in range(world)]
        for i in range(n + (rng.random() < 0.2 and not chain)):  # sometimes a page taken ahead
            for r in _holders(src, i, owner, world):
                if i < len(prefix):
                    alloc[r].incref([prefix[i][r]])
                    tables[r].append(prefix[i][r])
                else:
                    tables[r] += alloc[r].allocate(1)
        if chain:
            keys = [bytes([j, i, 0, 1]) for i in range(n)]
            for i in range(n):
                for r in _holders(src, i, owner, world):
                    page = tables[r][_local(src, i, world)]
                    alloc[r].register(page, keys[i], keys[i - 1] if i else None, i)
            for r in range(world):
                alloc[r].free(tables[r])  # cached, held by nobody
            chains.append(CachedHistory(f"\x00chain{j}", tables, owner, keys, rows))
        else:
            req = Request(f"r{j}", [1, 2], SamplingParams())
            req.num_computed, req.owner, req.tables = rows, owner, tables
            reqs.append(req)
    return alloc, reqs, chains


def _expected_moves(src: str, dst: str, hists, owners: dict, world: int, ps: int,
                    rows_from: dict, staged: dict) -> dict:
    """(history, page, rank) -> (source rank, source page, first row, rows, staged page or None,
    receiver key or None) for every received page, in history/page/rank order."""
    out, first_of = {}, {}
    for h in hists:
        n = -(-h.num_computed // ps)
        for i in range(n):
            src_h = _holders(src, i, h.owner, world)
            for d in _holders(dst, i, owners[h.request_id], world):
                if d in src_h:
                    continue
                s = min(src_h)
                page = h.tables[s][_local(src, i, world)]
                fill = min(ps, h.num_computed - i * ps)
                start = max(rows_from.get(h.request_id, 0) - i * ps, 0)
                st = staged.get((h.request_id, i, d))
                key = None
                if fill == ps and st is None:
                    key = first_of.setdefault((s, page, d), (h.request_id, i, d))
                out[(h.request_id, i, d)] = (s, page, start, max(fill - start, 0), st, key)
    return out


def _delivered(m, world: int, ps: int) -> dict:
    """(destination rank, slot) -> (source rank, slot) from the runs; each slot written once."""
    got = {}
    for s, d in itertools.product(range(world), repeat=2):
        send, recv = m.kv[s].send_runs[d], m.kv[d].recv_runs[s]
        assert len(send) == len(recv) and send[1::2] == recv[1::2]
        for a, b, n in zip(send[::2], recv[::2], send[1::2]):
            for k in range(n):
                assert (d, b + k) not in got, "a slot written twice"
                got[(d, b + k)] = (s, a + k)
    return got


def _check(m, src: str, dst: str, reqs, chains, world: int, ps: int, old: dict,
           rows_from: dict, staged: dict, delivered: dict) -> None:
    """``m`` against the page rule; ``old``: each history's tables before; ``delivered``
    gathers the slots written across a pre-copy and its delta."""
    hists = [*reqs, *chains]
    moves = _expected_moves(src, dst, [_with(h, old) for h in hists], m.new_owners, world, ps,
                            rows_from, staged)
    got = _delivered(m, world, ps)
    assert not got.keys() & delivered.keys()
    delivered.update(got)
    where: dict = {}  # received (history, page, rank) -> its page at the destination
    kept = [set() for _ in range(world)]
    received_rows = [0] * world
    sent_rows = [0] * world
    fresh = [set() for _ in range(world)]
    for h in hists:
        new = m.new_tables.get(h.request_id, [[] for _ in range(world)])
        n = -(-h.num_computed // ps)
        for d in range(world):
            held = [i for i in range(n) if d in _holders(dst, i, m.new_owners[h.request_id], world)]
            assert len(new[d]) == len(held)  # the destination's table, whole
            for i in held:
                page = new[d][_local(dst, i, world)]
                if (h.request_id, i, d) not in moves:  # kept: the page the rank held
                    assert page == old[h.request_id][d][_local(src, i, world)]
                    kept[d].add(page)
                    continue
                s, spage, start, rows, st, key = moves[(h.request_id, i, d)]
                where[(h.request_id, i, d)] = page
                if st is not None:
                    assert page == st  # into the page the pre-copy placed
                elif key not in (None, (h.request_id, i, d)):  # full: another history receives it
                    assert page == where[key] and rows == ps
                    continue
                else:
                    fresh[d].add(page)
                for k in range(start, start + rows):
                    assert got[(d, page * ps + k)] == (s, spage * ps + k)
                received_rows[d] += rows
                sent_rows[s] += rows
    ids = [h.request_id for h in hists]
    order = {}  # (rank, page) -> (history, page) of the entry that receives it
    for (rid, i, d), page in where.items():
        order.setdefault((d, page), (ids.index(rid), i))
    for s, d in itertools.product(range(world), repeat=2):  # runs in history, page order
        at = [order[(d, slot // ps)] for slot in m.kv[d].recv_runs[s][::2]]
        assert at == sorted(set(at))
    for rank, summary in enumerate(m.summary):
        assert summary.kv_rows_received == received_rows[rank]
        assert summary.kv_rows_sent == sent_rows[rank]
        assert summary.pages_received == len(fresh[rank])
        assert summary.pages_kept == len(kept[rank])
        assert summary.pages_discarded == len(set(m.discard[rank]) - kept[rank])
    for rank in range(world):  # the requests' references to pages they no longer hold
        want = []
        for r in reqs:
            new = set(m.new_tables.get(r.request_id, [[] for _ in range(world)])[rank])
            want += [p for p in old[r.request_id][rank] if p not in new]
        assert m.discard[rank] == want


def _with(h, old: dict):
    """``h`` as it stood before the switch (its old tables)."""
    clone = Request(h.request_id, [1], SamplingParams()) if isinstance(h, Request) else \
        CachedHistory(h.request_id, [], h.owner, h.block_hashes, h.num_computed)
    clone.num_computed, clone.owner, clone.tables = h.num_computed, h.owner, old[h.request_id]
    return clone


def _refs_match_tables(alloc, reqs, world: int, pool: int) -> None:
    """After a switch is carried out, every page is held exactly by the requests' tables."""
    for rank in range(world):
        want = [0] * pool
        for r in reqs:
            for p in r.tables[rank]:
                want[p] += 1
        assert [alloc[rank].refcount(p) for p in range(pool)] == want


def _fits(moves: dict, alloc, world: int) -> bool:
    need = [set() for _ in range(world)]
    for (rid, i, d), (_, _, _, _, st, key) in moves.items():
        if st is None:
            need[d].add(key or (rid, i, d))
    return all(len(need[d]) <= alloc[d].num_available for d in range(world))


def _apply(m, reqs, chains, alloc, world: int) -> None:
    """What the engine does once the switch step ran."""
    for h in [*reqs, *m.cached]:
        h.tables = m.new_tables.get(h.request_id, [[] for _ in range(world)])
        h.owner = m.new_owners[h.request_id]
    for rank in range(world):
        alloc[rank].free(m.discard[rank])
        alloc[rank].free(m.release[rank])


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("seed", range(6))
def test_manifest_matches_the_page_rule(world, seed):
    """One switch in each direction, built within one step (cached chains along)."""
    for src, dst in DIRECTIONS:
        rng = random.Random(f"{seed}-{world}-{src}-{dst}")
        ps, pool = rng.choice([1, 2, 4]), 400
        alloc, reqs, chains = _state(rng, src, world, ps, pool)
        old = {h.request_id: [list(t) for t in h.tables] for h in [*reqs, *chains]}
        tight = rng.random() < 0.4  # leave a few pages free on each rank
        filler = [alloc[r].allocate(max(alloc[r].num_free - rng.randint(0, 12), 0) if tight else 0)
                  for r in range(world)]
        before = [(list(a._free), list(a._refs)) for a in alloc.ranks]
        m = build_manifest(LAYOUTS[src], LAYOUTS[dst], reqs, alloc, world, ps, HEADS,
                           cached=chains)
        if m is None:  # not even the requests' pages fit: nothing taken
            moves = _expected_moves(src, dst, reqs, _owners(src, dst, reqs, world), world, ps,
                                    {}, {})
            assert not _fits(moves, alloc, world)
            assert [(list(a._free), list(a._refs)) for a in alloc.ranks] == before
            continue
        _check(m, src, dst, reqs, m.cached, world, ps, old, {}, {}, {})
        for rank, pages in enumerate(filler):
            alloc[rank].free(pages)
        _apply(m, reqs, m.cached, alloc, world)
        _refs_match_tables(alloc, reqs, world, pool)


def _owners(src: str, dst: str, reqs, world: int) -> dict:
    return destination_owners(LAYOUTS[src], LAYOUTS[dst], reqs, world)


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("seed", range(4))
def test_precopy_and_handoff_move_every_row_once(world, seed):
    """A pre-copy, rows written meanwhile (new pages taken under the source), one request
    finished, then the delta into the staged pages: together they deliver every row of every
    received page once, from a source holder."""
    for src, dst in DIRECTIONS:
        rng = random.Random(f"handoff-{seed}-{world}-{src}-{dst}")
        ps = rng.choice([2, 4])
        alloc, reqs, _ = _state(rng, src, world, ps, 600)
        old = {r.request_id: [list(t) for t in r.tables] for r in reqs}
        pre = build_manifest(LAYOUTS[src], LAYOUTS[dst], reqs, alloc, world, ps, HEADS)
        assert pre is not None
        delivered: dict = {}
        _check(pre, src, dst, reqs, [], world, ps, old, {}, {}, delivered)
        copied = {r.request_id: r.num_computed for r in reqs}
        for r in reqs:  # decodes meanwhile, pages taken under the source as needed
            r.num_computed += rng.choice([0, 1, 3, ps + 1])
            n = -(-r.num_computed // ps)
            for i in range(n):
                for h in _holders(src, i, r.owner, world):
                    while len(r.tables[h]) <= _local(src, i, world):
                        r.tables[h] += alloc[h].allocate(1)
        done = reqs.pop(rng.randrange(len(reqs))) if len(reqs) > 1 else None
        live = {r.request_id for r in reqs}
        if done is not None:  # finished during the pre-copy: its pages and staged pages go
            for h in range(world):
                alloc[h].free(done.tables[h])
        free_placed(pre.placed, alloc, keep=live)
        if done is not None:  # its received pages no one else holds may be reused
            for (_, d), page in _cells(pre.placed[done.request_id]):
                for k in range(ps if page >= 0 and not alloc[d].refcount(page) else 0):
                    delivered.pop((d, page * ps + k), None)
        staged = {rid: pages for rid, pages in pre.placed.items() if rid in live}
        old = {r.request_id: [list(t) for t in r.tables] for r in reqs}
        owners = {rid: o for rid, o in pre.new_owners.items() if rid in live}
        delta = build_manifest(LAYOUTS[src], LAYOUTS[dst], reqs, alloc, world, ps, HEADS,
                               owners=owners, rows_from=copied, staged=staged)
        assert delta is not None
        staged_at = {(rid, i, d): int(p) for rid, a in staged.items()
                     for (i, d), p in _cells(a) if p >= 0}
        _check(delta, src, dst, reqs, [], world, ps, old, copied, staged_at, delivered)
        for r in reqs:  # the two together: every row of every received page, once
            for i in range(-(-r.num_computed // ps)):
                for d in _holders(dst, i, delta.new_owners[r.request_id], world):
                    if d not in _holders(src, i, r.owner, world):
                        page = delta.new_tables[r.request_id][d][_local(dst, i, world)]
                        for k in range(min(ps, r.num_computed - i * ps)):
                            assert (d, page * ps + k) in delivered
        _apply(delta, reqs, [], alloc, world)
        _refs_match_tables(alloc, reqs, world, 600)


def _cells(pages):
    """((logical page, rank), page) of a (pages, world) array."""
    return [((i, d), p) for i, row in enumerate(pages.tolist()) for d, p in enumerate(row)]
