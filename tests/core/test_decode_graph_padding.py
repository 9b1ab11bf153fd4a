"""The padding a CUDA-graph decode step uses (splash/engine/graphs.py), on host data only:
ghost rows get no KV slot and KV length 0, real rows keep theirs, and owner-held layouts pad
every rank to the same row count."""

from __future__ import annotations

import pytest
import torch

from splash.core.ownership import LAYOUTS, KVPlacement
from splash.core.protocol import WORKER_PROTOCOL_VERSION, SeqSampling, StepPlan
from splash.dist.comm import Comm
from splash.engine.graphs import (
    DecodeGraphs,
    batch_buckets,
    ghost_plan,
    graph_width,
    startup_graph_keys,
    startup_layouts,
)
from splash.layouts.base import StepMeta

PS = 4


class _Impl:  # what DecodeGraphs.pad reads of a layout implementation
    def __init__(self, name: str) -> None:
        self.layout = LAYOUTS[name]


def _plan(owners: list[int], contexts: list[int]) -> StepPlan:
    n = len(owners)
    return StepPlan(
        version=WORKER_PROTOCOL_VERSION, step=7, layout="tp",
        request_ids=[f"r{i}" for i in range(n)], query_lens=[1] * n, context_lens=contexts,
        owners=owners, input_ids=[5 + i for i in range(n)], positions=[c - 1 for c in contexts],
        sample=[True] * n, sampling=[SeqSampling(0.0, 1.0, 0, None)] * n, output_index=[0] * n)


def _graphs(world: int, rank: int = 0) -> DecodeGraphs:
    return DecodeGraphs(lambda *a: None, Comm(rank, world, use_dist=False), PS,
                        torch.device("cpu"), max_batch=16, capture=False)


def test_buckets_cover_every_batch_size():
    buckets = batch_buckets(256)
    assert buckets[:5] == [1, 2, 4, 8, 16] and buckets[-1] == 256
    assert all(a < b for a, b in zip(buckets, buckets[1:]))
    assert batch_buckets(5)[-1] == 5


@pytest.mark.parametrize("layout", ["tp", "cp"])
def test_ghosts_write_nothing_and_attend_nothing(layout):
    world = 2
    plan = _plan([0, 1, 0], [6, 9, 1])  # 3 requests -> padded to 4
    padded = _graphs(world).pad(plan, _Impl(layout))
    assert padded is not None and len(padded.request_ids) == 4
    assert padded.sample == [True, True, True, False] and padded.context_lens[-1] == 0
    tables = {"r0": [10, 11], "r1": [20, 21, 22], "r2": [30]}
    for rank in range(world):
        meta = StepMeta(padded, tables, rank, world, PS, torch.device("cpu"), table_width=4)
        ref = StepMeta(plan, tables, rank, world, PS, torch.device("cpu"))
        slots = meta.write_slots(LAYOUTS[layout], list(range(4))).tolist()
        assert slots[:3] == ref.write_slots(LAYOUTS[layout], [0, 1, 2]).tolist()
        assert slots[3] == -1  # a ghost never writes (it has no page on any rank)
        args = meta.kernel_args(LAYOUTS[layout], list(range(4)))
        assert args["seq_lens"].tolist()[3] == 0 and args["block_table"].shape[1] == 4


def test_owner_layouts_pad_every_rank_to_the_same_rows():
    plan = _plan([0, 0, 0, 1], [3, 3, 3, 3])  # rank 0 owns 3 rows, rank 1 owns 1
    padded = _graphs(2).pad(plan, _Impl("dop"))
    assert padded is not None
    counts = [padded.owners.count(r) for r in range(2)]
    assert counts == [4, 4]  # each rank padded to the bucket of the largest (3 -> 4)
    assert padded.request_ids[:4] == plan.request_ids


def test_not_padded_when_not_a_pure_decode_or_too_large():
    g = _graphs(1)
    prefill = StepPlan(WORKER_PROTOCOL_VERSION, 1, "tp", ["a"], [3], [3], [0], [1, 2, 3],
                       [0, 1, 2], [True], [SeqSampling(0.0, 1.0, 0, None)], [0])
    assert g.pad(prefill, _Impl("tp")) is None
    assert g.pad(_plan([0] * 17, [2] * 17), _Impl("tp")) is None  # above max_batch 16


@pytest.mark.parametrize(("world", "start", "resident", "expected"), [
    (1, "tp", False, ["tp", "dp", "cp", "dop"]),  # one rank holds every head in every layout
    (2, "tp", False, ["tp", "dop"]),  # head-sharded placement: the replicated one comes later
    (2, "dp", False, ["dp", "cp"]),
    (2, "tp", True, ["tp", "dp", "cp", "dop"]),  # resident projections: every placement held
])
def test_startup_captures_every_decode_step_of_the_held_layouts(world, start, resident,
                                                                expected):
    """The start-up list (the same on every rank: it depends on nothing rank-specific) holds
    the key of every decode step those layouts can replay at the start-up width, each once,
    largest batch first within a layout, so no such step captures while serving."""
    layouts = startup_layouts(["tp", "dp", "cp", "dop"], start, world, resident)
    assert layouts == expected
    width = graph_width(64, PS)  # start-up graphs cover contexts up to 64 tokens
    g = DecodeGraphs(lambda *a: None, Comm(0, world, use_dist=False), PS, torch.device("cpu"),
                     max_batch=16, capture=False, min_width=width)
    keys = startup_graph_keys(layouts, g.buckets, [width], world)
    assert len(keys) == len(set(keys)) == len(layouts) * len(g.buckets)
    for name in layouts:
        rows = [k[1] for k in keys if k[0] == name]
        assert rows == sorted(rows, reverse=True)
    seen, longer = set(), set()
    for name in layouts:
        for n in range(1, 16 * world + 1):  # up to the largest bucket on every owner
            for ctx in (1, 13, 40, 64, 65, 200):
                plan = _plan([i % world for i in range(n)], [ctx] * n)
                padded = g.pad(plan, _Impl(name))
                if padded is None:  # above the largest bucket: runs eagerly
                    assert n > 16 and LAYOUTS[name].kv is not KVPlacement.OWNED
                    continue
                (seen if ctx <= 64 else longer).add(g.key(plan, padded, _Impl(name)))
    assert seen == set(keys)  # every step up to the start-up context replays a start-up graph
    assert not longer & set(keys)  # longer contexts: wider tables, captured when first met


@pytest.mark.parametrize("layout", ["tp", "dop"])
def test_ghost_steps_have_the_structure_of_real_ones(layout):
    """A start-up graph is captured from ghost rows; the real step it later replays must build
    inputs of the same structure (else the replay would fall back to eager)."""
    world = 2
    g = _graphs(world)
    plan = _plan([0, 1, 1], [6, 9, 2])
    padded = g.pad(plan, _Impl(layout))
    assert padded is not None
    ghost = ghost_plan(LAYOUTS[layout], len(padded.request_ids), world)
    if LAYOUTS[layout].kv is KVPlacement.OWNED:  # the same rows on every owner
        assert [ghost.owners.count(r) for r in range(world)] == \
            [padded.owners.count(r) for r in range(world)]
    tables = {"r0": [1, 2], "r1": [3, 4, 5], "r2": [6]}
    for rank in range(world):
        real = StepMeta(padded, tables, rank, world, PS, torch.device("cpu"), table_width=4)
        fake = StepMeta(ghost, {}, rank, world, PS, torch.device("cpu"), table_width=4)
        a = real.kernel_args(LAYOUTS[layout], list(range(len(padded.request_ids))))
        b = fake.kernel_args(LAYOUTS[layout], list(range(len(ghost.request_ids))))
        assert {k: getattr(v, "shape", v) for k, v in a.items()} == \
            {k: getattr(v, "shape", v) for k, v in b.items()}
        assert fake.write_slots(LAYOUTS[layout], list(range(len(ghost.request_ids)))).eq(-1).all()


@pytest.mark.parametrize("free_mib, peer_ok, want", [(400, True, True), (200, True, False),
                                                     (400, False, False)])
def test_other_placement_graphs_need_room_on_every_rank(monkeypatch, free_mib, peer_ok, want):
    """Start-up graphs of the other projection placement are captured only when every rank has
    1.25 × the start placement's per-layout graph memory free for each of them (here 2 layouts
    of 100 MiB each took 200 MiB, so 2 more need 250 MiB); a peer short of it stops all."""
    from types import SimpleNamespace

    from splash.engine.startup_graphs import room_for_other_placement

    mib = 2**20
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 1000 * mib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1000 * mib)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free_mib * mib, 0))
    sharded, full = range(0, 2), range(0, 4)
    held = {"tp": sharded, "dop": sharded, "dp": full, "cp": full}
    votes = []

    def all_agree(ok, device):
        votes.append(ok)
        return ok and peer_ok

    room = room_for_other_placement(SimpleNamespace(all_agree=all_agree), torch.device("cpu"),
                                    0, ["tp", "dop", "dp", "cp"], held.__getitem__, sharded,
                                    800 * mib)
    assert room is want
    assert votes == [free_mib >= 250]
