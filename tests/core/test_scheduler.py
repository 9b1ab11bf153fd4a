"""Controller step planning without workers (milliseconds): batching, chunked prefill, page
admission, owners, preemption, and the per-rank plans the workers receive."""

from __future__ import annotations

import pytest

from splash.core.allocator import RankAllocators
from splash.core.ownership import LAYOUTS, num_local_pages
from splash.core.request import Request
from splash.engine.plans import build_plans
from splash.engine.scheduler import Scheduler, SchedulerConfig
from splash.sampling_params import SamplingParams

PS = 4


def _sched(layout="dop", world=2, pages=64, budget=16, chunked=True):
    alloc = RankAllocators(world, pages)
    cfg = SchedulerConfig(world, PS, 1024, max_num_batched_tokens=budget,
                          enable_chunked_prefill=chunked)
    return Scheduler(cfg, alloc, LAYOUTS[layout]), alloc


def _req(i, n, max_tokens=4):
    # distinct prompts: nothing is shared through the prefix cache (test_prefix_cache covers it)
    return Request(f"r{i}", list(range(2 + 100 * i, 2 + 100 * i + n)),
                   SamplingParams(max_tokens=max_tokens))


def _advance(batch):
    for req, n in batch.entries:
        req.num_computed += n
        if req.num_computed == req.num_tokens:
            req.output_token_ids.append(7)


def test_chunked_prefill_respects_budget_and_decodes_first():
    sched, _ = _sched(budget=16)
    for i, n in enumerate((30, 5)):
        sched.add(_req(i, n))
    b1 = sched.schedule()
    assert [(r.request_id, n) for r, n in b1.entries] == [("r0", 16)]
    _advance(b1)
    b2 = sched.schedule()
    assert [(r.request_id, n) for r, n in b2.entries] == [("r0", 14), ("r1", 2)]
    _advance(b2)
    b3 = sched.schedule()  # r0 decodes (1 row) before r1's prefill continues
    assert [(r.request_id, n) for r, n in b3.entries] == [("r0", 1), ("r1", 3)]


def test_unchunked_prefill_takes_whole_prompt():
    sched, _ = _sched(budget=16, chunked=False)
    sched.add(_req(0, 12))
    sched.add(_req(1, 10))  # does not fit whole beside the first: waits for the next step
    assert [n for _, n in sched.schedule().entries] == [12]


@pytest.mark.parametrize("chunked", [True, False])
def test_no_step_exceeds_the_profiled_size(chunked):
    """Whatever arrives, no step holds more rows than max_num_batched_tokens (the prefill the
    workers profiled) nor more decodes than max_num_seqs: long prompts, and with chunked
    prefill off, requests preempted with more pending rows than one step holds."""
    budget, seqs = 16, 3
    alloc = RankAllocators(1, 12)  # a small pool: preemption recomputes prompt + outputs
    cfg = SchedulerConfig(1, PS, 1024, max_num_seqs=seqs, max_num_batched_tokens=budget,
                          enable_chunked_prefill=chunked)
    sched = Scheduler(cfg, alloc, LAYOUTS["tp"])
    back = _req(9, 12, max_tokens=20)  # as a preempted request returns: outputs to recompute
    back.output_token_ids = [7] * 10
    sched.add(back)
    for i, n in enumerate((12, 16, 5, 9, 14, 3)):
        sched.add(_req(i, n, max_tokens=20))
    steps = 0
    while sched.has_unfinished() and steps < 500:
        batch = sched.schedule()
        rows = [n for _, n in batch.entries]
        assert sum(rows) <= budget
        assert sum(1 for n in rows if n == 1) <= seqs
        _advance(batch)
        for req, _ in list(batch.entries):
            if len(req.output_token_ids) >= req.params.max_tokens and req in sched.running:
                sched.finish(req, "length")
        steps += 1
    assert not sched.has_unfinished()
    assert sched.num_preemptions > 0 or not chunked  # unchunked admits one prompt at a time


@pytest.mark.parametrize("layout", ["tp", "dp", "cp", "dop"])
def test_pages_follow_kv_placement(layout):
    sched, alloc = _sched(layout, world=2)
    for i, n in enumerate((9, 14, 3)):
        sched.add(_req(i, n))
    _advance(sched.schedule())
    for req in sched.running:
        logical = -(-req.num_computed // PS)
        for rank in range(2):
            want = num_local_pages(LAYOUTS[layout], logical, rank, req.owner, 2)
            assert len(req.tables[rank]) == want
    assert sum(alloc.used()) == sum(len(t) for r in sched.running for t in r.tables)


def test_owners_balanced_by_live_tokens():
    sched, _ = _sched("dp", world=2, budget=512)
    for i, n in enumerate((40, 10, 10, 10, 10)):
        sched.add(_req(i, n))
    _advance(sched.schedule())
    load = sched.live_tokens_by_rank()
    assert abs(load[0] - load[1]) <= 10


def test_preemption_by_recompute_frees_and_requeues():
    sched, alloc = _sched("tp", world=1, pages=6, budget=64)
    for i in range(3):
        sched.add(_req(i, 7, max_tokens=10))
    _advance(sched.schedule())  # 3 x 2 pages
    for _ in range(2):
        b = sched.schedule()
        _advance(b)
    assert sched.num_preemptions >= 1
    victim = sched.waiting[0]
    assert victim.num_computed == 0 and all(not t for t in victim.tables)
    assert alloc.used()[0] == sum(len(r.tables[0]) for r in sched.running)


def test_lone_request_that_cannot_fit_finishes_with_error():
    sched, _ = _sched("tp", world=1, pages=2, budget=64)
    req = _req(0, 7, max_tokens=10)
    sched.add(req)
    _advance(sched.schedule())
    for _ in range(3):
        _advance(sched.schedule())
    assert req.finish_reason == "error" and "KV" in req.error


def test_plans_carry_incremental_tables_per_rank():
    sched, _ = _sched("cp", world=2, budget=64)
    sched.add(_req(0, 10))
    batch = sched.schedule()
    plans = build_plans(sched, batch, None, step=0)
    req = sched.running[0]
    assert [p.table_updates[0].pages for p in plans] == [req.tables[0], req.tables[1]]
    assert plans[0].positions == list(range(10)) and plans[0].sample == [True]
    _advance(batch)
    plans = build_plans(sched, sched.schedule(), None, step=1)  # position 10 opens no new page
    assert [p.table_updates for p in plans] == [[], []]
