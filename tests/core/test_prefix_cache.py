"""Prefix caching and page sharing on the controller (no workers, milliseconds): reference
counts and LRU eviction, hits under every layout (their holders), pages shared within a step,
cache-aware owners in DP, forks with copy-on-write, and switch manifests that move a shared
page once and carry unreferenced cached chains to their new holders."""

from __future__ import annotations

import pytest

from splash.core.allocator import PageAllocator, RankAllocators
from splash.core.ownership import LAYOUTS, local_page_index, page_holders
from splash.core.prefix_cache import cached_histories
from splash.core.request import Request, SampleGroup, Status
from splash.engine.scheduler import Scheduler, SchedulerConfig
from splash.sampling_params import SamplingParams, sample_seed
from splash.switching.manifest import build_manifest

PS = 4
PROMPT = list(range(10, 31))  # 21 tokens: 5 full pages + 1


def _sched(layout="tp", world=2, pages=64, budget=64, cache=True):
    alloc = RankAllocators(world, pages)
    cfg = SchedulerConfig(world, PS, 1024, max_num_batched_tokens=budget,
                          enable_prefix_caching=cache)
    return Scheduler(cfg, alloc, LAYOUTS[layout]), alloc


def _req(rid, prompt, **kw):
    return Request(rid, list(prompt), SamplingParams(max_tokens=4, **kw))


def _step(sched):
    batch = sched.schedule()
    for req, n in batch.entries:
        req.num_computed += n
        if req.num_computed == req.num_tokens:
            req.output_token_ids.append(7)
    return batch


def _run_to_first_token(sched, req):
    sched.add(req)
    while not req.output_token_ids:
        _step(sched)


def test_allocator_refcounts_and_lru_eviction():
    a = PageAllocator(4)
    p = a.allocate(3)
    for i, page in enumerate(p):
        a.register(page, bytes([i]), bytes([i - 1]) if i else None, i)
    a.incref(p[:1])  # shared by a second holder
    a.free(p)  # first holder done: p[0] still held, p[1:] cached and evictable
    assert a.num_used == 1 and a.num_cached == 3 and a.num_available == 3
    assert a.lookup(bytes([2])) == p[2]
    a.incref([p[1]])  # a hit takes a cached page back
    assert a.num_used == 2
    a.free([p[1]])
    # LRU: the free page first, then the oldest cached page: p[2] (freed earlier than p[1])
    got = a.allocate(2)
    assert got[1] == p[2] and a.lookup(bytes([2])) is None and a.lookup(bytes([1])) == p[1]
    a.free(got + [p[0]])
    with pytest.raises(ValueError):
        a.free([p[0]])  # more often than held
    a.clear_cache()
    assert a.num_cached == 0 and a.num_free == 4


@pytest.mark.parametrize("layout", ["tp", "dp", "cp", "dop"])
def test_hit_on_every_holder(layout):
    sched, alloc = _sched(layout)
    first = _req("a", PROMPT)
    _run_to_first_token(sched, first)
    sched.finish(first, "stop")
    second = _req("b", PROMPT[:18] + [99, 98])
    sched.add(second)
    batch = sched.schedule()
    assert batch.entries == [(second, 20 - 16)]  # 4 cached pages, the rest computed
    assert sched.prefix.hit_tokens == 16 and sched.prefix.queried_tokens == 21 + 20
    lay = LAYOUTS[layout]
    assert second.owner == first.owner  # DP/DOP: the owner holding the prefix
    for i in range(4):
        for d in page_holders(lay, i, second.owner, 2):
            page = second.tables[d][local_page_index(lay, i, 2)]
            assert alloc[d].lookup(sched.prefix.hashes(second)[i]) == page


def test_whole_prompt_cached_still_computes_its_last_token():
    sched, _ = _sched("tp")
    first = _req("a", PROMPT[:20])  # 5 full pages
    _run_to_first_token(sched, first)
    again = _req("b", PROMPT[:20])
    sched.add(again)
    assert sched.schedule().entries[-1] == (again, 4)  # page 5 is recomputed for its logits


def test_same_step_requests_share_pages_and_prefills_leapfrog():
    sched, alloc = _sched("tp", world=1, budget=12)
    reqs = [_req(f"r{i}", PROMPT) for i in range(3)]
    for r in reqs:
        sched.add(r)
    computed = 0
    while not all(r.output_token_ids for r in reqs):
        computed += _step(sched).num_rows
    # 21 prompt tokens computed once, plus the last (uncacheable) page of the other two
    assert computed == 21 + 2 * 1
    assert alloc.used() == [6 + 2]  # 5 shared full pages + one partial page each


def test_dp_admission_follows_the_cache_unless_load_says_otherwise():
    sched, _ = _sched("dp", budget=256)
    first = _req("a", PROMPT)
    _run_to_first_token(sched, first)
    owner = first.owner
    sched.add(_req("b", PROMPT[:16] + [5]))  # 16 cached tokens on `owner`
    _step(sched)
    assert sched.running[-1].owner == owner
    heavy = _req("c", list(range(100, 400)))  # 300 live tokens more on `owner`
    heavy.owner, heavy.tables = owner, [[], []]
    sched.running.append(heavy)
    heavy.num_computed = 300
    heavy.status = Status.RUNNING
    late = _req("d", PROMPT[:16] + [6])
    sched.add(late)
    _step(sched)
    assert late.owner != owner  # 300 more tokens there outweigh 16 cached ones


def test_prompt_logprobs_bypass_the_cache():
    sched, _ = _sched("tp")
    _run_to_first_token(sched, _req("a", PROMPT))
    scored = _req("b", PROMPT, prompt_logprobs=1)
    sched.add(scored)
    assert sched.schedule().entries[-1] == (scored, 21)


def test_cache_off_shares_nothing():
    sched, alloc = _sched("tp", cache=False)
    _run_to_first_token(sched, _req("a", PROMPT))
    b = _req("b", PROMPT)
    sched.add(b)
    assert sched.schedule().entries[-1] == (b, 21)
    assert alloc[0].num_cached == 0


@pytest.mark.parametrize("layout", ["tp", "cp", "dop"])
def test_fork_shares_pages_and_copies_the_partial_page_on_write(layout):
    sched, alloc = _sched(layout)
    parent = _req("p", PROMPT, n=3, temperature=1.0, seed=5)
    parent.group = SampleGroup("p", 3, [parent])
    sched.add(parent)
    while parent.num_computed < len(PROMPT):
        batch = sched.schedule()
        for req, n in batch.entries:
            req.num_computed += n
    used = alloc.used()
    children = sched.fork(parent)  # the prompt's last row drew 3 tokens
    assert alloc.used() == used  # shared: no new page
    assert [c.params.seed for c in children] == [sample_seed(5, 1), sample_seed(5, 2)]
    assert parent.group.members == [parent, *children] and not parent.fork_pending
    for r in (parent, *children):
        r.output_token_ids.append(8)
    lay = LAYOUTS[layout]
    holders = page_holders(lay, 5, parent.owner, 2)  # page 5 holds token 20 and the next row
    batch = _step(sched)
    assert [r for r, _ in batch.entries] == [parent, *children]
    copies = {d: sched.take_copies(d) for d in range(2)}
    for d in range(2):
        # two of the three writers copy first; the last writes the original page in place
        assert len(copies[d]) == (2 if d in holders else 0)
        local = local_page_index(lay, 5, 2)
        if d in holders:
            pages = {r.tables[d][local] for r in (parent, *children)}
            assert len(pages) == 3 and all(alloc[d].refcount(p) == 1 for p in pages)
            assert {src for src, _ in copies[d]} <= pages
        for i in range(5):  # full pages stay shared by all three
            for h in page_holders(lay, i, parent.owner, 2):
                page = parent.tables[h][local_page_index(lay, i, 2)]
                assert alloc[h].refcount(page) == 3
    for r in (parent, *children):
        sched.finish(r, "stop")
    assert alloc.used() == [0, 0]


def test_shared_pages_move_once_and_cached_chains_follow_the_switch():
    sched, alloc = _sched("dp")
    a = _req("a", PROMPT)
    _run_to_first_token(sched, a)
    b = _req("b", PROMPT[:16] + [1, 2, 3])
    _run_to_first_token(sched, b)
    gone = _req("c", list(range(50, 63)))  # 3 cached pages, unreferenced after finishing
    _run_to_first_token(sched, gone)
    sched.finish(gone, "stop")
    assert gone.owner != a.owner
    dp, tp = LAYOUTS["dp"], LAYOUTS["tp"]
    chains = cached_histories(alloc, dp, 2, PS)
    assert b.owner == a.owner and b.num_computed == 20  # 19 prompt tokens + 1 decoded
    # a's and b's 5 full pages (4 shared) and c's 3, as chains
    assert sorted(len(c.block_hashes) for c in chains) == [3, 5, 5]
    m = build_manifest(dp, tp, sched.running, alloc, 2, PS, 8, cached=chains)
    assert m is not None and len(m.cached) == 3
    # a and b share 4 pages: each moves once to the other rank, as does b's own 5th page;
    # the unreferenced chain's 3 pages move the other way
    other = 1 - a.owner
    assert m.summary[other].kv_rows_received == a.num_computed + 4
    assert m.summary[a.owner].kv_rows_received == 12  # c's chain, the other way
    for hist in [*sched.running, *m.cached]:  # what the switch controller does
        hist.tables = m.new_tables[hist.request_id]
        sched.prefix.register_moved(hist, tp)
    for rank in range(2):
        alloc[rank].free(m.discard[rank])
        alloc[rank].free(m.release[rank])
    late = _req("d", list(range(50, 62)) + [7])  # the chain no request held any more
    sched.layout = tp
    sched.add(late)
    sched.schedule()
    assert late.num_computed == 12 and all(len(t) == 4 for t in late.tables)
