"""Switch manifests derived from the ownership model: every direction's primitives match
the switch table (docs/switching.md), and the moved rows and bytes follow from page holders. Milliseconds, no
workers."""

from __future__ import annotations

import itertools

import pytest

from splash.core.allocator import RankAllocators
from splash.core.ownership import LAYOUTS, num_local_pages
from splash.core.request import Request
from splash.engine.scheduler import Scheduler, SchedulerConfig
from splash.sampling_params import SamplingParams
from splash.switching.manifest import build_manifest

PS, HEADS = 4, 8

# docs/switching.md: (weights, KV) primitive of each direction
EXPECTED = {
    ("tp", "dp"): ("all-gather", "discard"), ("tp", "cp"): ("all-gather", "discard"),
    ("tp", "dop"): ("keep", "discard"),
    ("dp", "tp"): ("discard", "all-gather"), ("dp", "cp"): ("keep", "all-to-all"),
    ("dp", "dop"): ("discard", "keep"),
    ("cp", "tp"): ("discard", "all-gather"), ("cp", "dp"): ("keep", "all-to-all"),
    ("cp", "dop"): ("discard", "all-to-all"),
    ("dop", "tp"): ("keep", "all-gather"), ("dop", "dp"): ("all-gather", "keep"),
    ("dop", "cp"): ("all-gather", "all-to-all"),
}


def _running(layout: str, world: int, lengths=(9, 14, 3, 21, 8)):
    alloc = RankAllocators(world, 256)
    sched = Scheduler(SchedulerConfig(world, PS, 512, max_num_batched_tokens=512), alloc,
                      LAYOUTS[layout])
    for i, n in enumerate(lengths):
        # distinct prompts: no page is shared (test_shared_pages_move_once covers sharing)
        sched.add(Request(f"r{i}", list(range(2 + 100 * i, 2 + 100 * i + n)),
                          SamplingParams(max_tokens=4)))
    batch = sched.schedule()
    for req, n in batch.entries:
        req.num_computed += n
    return sched, alloc


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("src,dst", list(EXPECTED))
def test_direction_primitives_and_rows(src, dst, world):
    sched, alloc = _running(src, world)
    used_before = alloc.used()
    m = build_manifest(LAYOUTS[src], LAYOUTS[dst], sched.running, alloc, world, PS, HEADS)
    assert m is not None
    assert (m.weight_op, m.kv_op) == EXPECTED[(src, dst)]
    total = sum(r.num_computed for r in sched.running)
    received = [s.kv_rows_received for s in m.summary]
    sent = [s.kv_rows_sent for s in m.summary]
    assert sum(received) == sum(sent)
    for rank in range(world):
        # every rank ends up holding exactly the pages the destination places on it
        for req in sched.running:
            logical = -(-req.num_computed // PS)
            want = num_local_pages(LAYOUTS[dst], logical, rank, m.new_owners[req.request_id], world)
            assert len(m.new_tables[req.request_id][rank]) == want
        if dst == "tp":  # all-gather: a rank receives exactly the tokens it lacked
            held = sum(r.num_computed for r in sched.running if src != "cp" and r.owner == rank)
            if src == "cp":
                held = sum(min(PS, r.num_computed - i * PS) for r in sched.running
                           for i in range(rank, -(-r.num_computed // PS), world))
            assert received[rank] == total - held
        if (src, dst) in (("tp", "dop"), ("dp", "dop"), ("tp", "dp"), ("dop", "dp")):
            assert received[rank] == 0  # pure discards / weight-only moves
    # the heads: sharded -> replicated receives all other ranks' heads
    if EXPECTED[(src, dst)][0] == "all-gather":
        assert all(s.heads_received == HEADS - HEADS // world for s in m.summary)
    for rank, pages in enumerate(m.discard):
        alloc[rank].free(pages)
    used_after = alloc.used()
    expected_after = [len({p for t in m.new_tables.values() for p in t[r]}) for r in range(world)]
    assert used_after == expected_after
    assert used_before != [0] * world


@pytest.mark.parametrize("src,dst", list(EXPECTED))
def test_resident_heads_move_no_weights(src, dst):
    """Every rank holding every layout's heads: no direction moves or frees a head, each rank
    ends on the destination's range, and the KV plan is the one without residency."""
    world = 2
    sched, alloc = _running(src, world)
    m = build_manifest(LAYOUTS[src], LAYOUTS[dst], sched.running, alloc, world, PS, HEADS,
                       resident_heads=True)
    assert m is not None and (m.weight_op, m.kv_op) == ("keep", EXPECTED[(src, dst)][1])
    for rank, (mv, s) in enumerate(zip(m.weights, m.summary)):
        assert mv.recv_from == [[], []] and mv.send_to == [[], []]
        want = range(HEADS) if LAYOUTS[dst].projections.name == "REPLICATED" else \
            range(rank * HEADS // world, (rank + 1) * HEADS // world)
        assert range(mv.head_start, mv.head_stop) == want
        assert (s.heads_received, s.heads_discarded, s.heads_kept) == (0, 0, len(want))


def test_predicted_bytes():
    sched, alloc = _running("dop", 2)
    m = build_manifest(LAYOUTS["dop"], LAYOUTS["tp"], sched.running, alloc, 2, PS, HEADS)
    pred = m.predicted_bytes(kv_row_bytes=1152, head_bytes=1000, num_layers=3)
    assert pred["kv_bytes_received"] == [s.kv_rows_received * 1152 * 3 for s in m.summary]
    assert pred["weight_bytes_received"] == [0, 0]


def test_deferred_when_pages_missing():
    sched, alloc = _running("dop", 2, lengths=(40, 40))
    for a in alloc.ranks:  # leave almost nothing free
        a.allocate(a.num_available - 1)
    before = [a.num_free for a in alloc.ranks]
    assert build_manifest(LAYOUTS["dop"], LAYOUTS["tp"], sched.running, alloc, 2, PS, HEADS) is None
    assert [a.num_free for a in alloc.ranks] == before  # nothing allocated


def test_owners_rebalanced_by_tokens_entering_owned_layout():
    sched, alloc = _running("tp", 2, lengths=(30, 10, 10, 10))
    m = build_manifest(LAYOUTS["tp"], LAYOUTS["dop"], sched.running, alloc, 2, PS, HEADS)
    load = [0, 0]
    for req in sched.running:
        load[m.new_owners[req.request_id]] += req.num_computed
    assert sorted(load) == [30, 30]  # the 30-token history alone; the three 10s together


def test_all_twelve_directions_listed():
    names = list(LAYOUTS)
    assert set(EXPECTED) == {(a, b) for a, b in itertools.permutations(names, 2)}


def test_cached_copies_on_the_receiver_are_taken_not_moved():
    """DP -> TP: a rank that has a request's full pages cached (same keys, e.g. left there by
    an earlier TP -> DP) takes those pages (one reference each) and receives only the rest."""
    from splash.core.prefix_cache import hash_page

    world = 2
    sched, alloc = _running("dp", world, lengths=(14, 9))
    req = next(r for r in sched.running if r.num_computed == 14)  # 3 full pages + 2 rows
    other = 1 - req.owner
    tokens = req.prompt_token_ids
    keys = []
    for i in range(3):
        keys.append(hash_page(keys[-1] if keys else None, tokens[i * PS:(i + 1) * PS]))
    req.block_hashes = list(keys)
    copies = alloc[other].allocate(3)
    alloc[other].register_many(copies, keys, [None, *keys[:2]], [0, 1, 2])
    alloc[other].free(copies)  # cached, unreferenced
    plain_sched, plain_alloc = _running("dp", world, lengths=(14, 9))
    plain = build_manifest(LAYOUTS["dp"], LAYOUTS["tp"], plain_sched.running, plain_alloc,
                           world, PS, HEADS)
    m = build_manifest(LAYOUTS["dp"], LAYOUTS["tp"], sched.running, alloc, world, PS, HEADS)
    assert m is not None and plain is not None
    assert m.summary[other].pages_reused == 3 and m.summary[req.owner].pages_reused == 0
    assert m.new_tables[req.request_id][other][:3] == copies
    assert [alloc[other].refcount(p) for p in copies] == [1, 1, 1]
    assert m.summary[other].kv_rows_received == plain.summary[other].kv_rows_received - 12
    assert m.summary[other].pages_received == plain.summary[other].pages_received - 3
