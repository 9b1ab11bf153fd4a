"""One source of "who holds what": the engine's switch manifests and the planner (cost model,
feasibility) place owners and count held tokens with the same functions, so the policy plans
for the placement the engine makes. Random loads, with ties and empty histories."""

from __future__ import annotations

import random

import numpy as np
import pytest

from splash.backends.profiles import PROFILES
from splash.core.allocator import RankAllocators
from splash.core.ownership import (
    LAYOUTS,
    cp_gather_map,
    holders,
    holds,
    local_kv_len,
    local_page_index,
    num_local_pages,
    page_holders,
)
from splash.core.request import Request
from splash.model.config import ModelConfig
from splash.model.presets import preset_config
from splash.planning.cost_model import CostModel
from splash.planning.feasibility import Feasibility
from splash.sampling_params import SamplingParams
from splash.switching.manifest import build_manifest

PS = 16


def _running(src: str, tokens: list[int], world: int) -> tuple[list[Request], RankAllocators]:
    """Requests live under ``src`` with these KV lengths, their pages taken as the scheduler
    takes them (owners balanced round-robin under an owned source)."""
    alloc = RankAllocators(world, 4096)
    reqs = []
    for i, t in enumerate(tokens):
        req = Request(f"r{i}", [1] * max(t, 1), SamplingParams())
        req.num_computed, req.owner = t, i % world
        pages = -(-t // PS)
        req.tables = [alloc[r].allocate(num_local_pages(LAYOUTS[src], pages, r, req.owner, world))
                      for r in range(world)]
        reqs.append(req)
    return reqs, alloc


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("src,dst", [("tp", "dp"), ("tp", "dop"), ("cp", "dp"), ("cp", "dop")])
def test_engine_and_cost_model_place_owners_identically(world, seed, src, dst):
    rng = random.Random(seed * 31 + world)
    n = rng.randint(1, 3 * world)
    tokens = [rng.choice([0, 0, 1, PS, PS + 1, 4 * PS, rng.randint(0, 300)]) for _ in range(n)]
    reqs, alloc = _running(src, tokens, world)
    manifest = build_manifest(LAYOUTS[src], LAYOUTS[dst], reqs, alloc, world, PS, 8)
    assert manifest is not None
    engine_owners = [manifest.new_owners[r.request_id] for r in reqs]

    cm = CostModel(ModelConfig.from_hf(preset_config("deepseek-v3")), world, PROFILES["h200"],
                   page_size=PS)
    assert engine_owners == cm.owners(tokens).tolist()
    # the KV the policy's feasibility check plans per rank is what the engine's tables hold
    engine_held = [sum(len(manifest.new_tables.get(r.request_id, [[]] * world)[rank])
                       for r in reqs) * PS for rank in range(world)]
    assert Feasibility(cm.memory).held_tokens(dst, tokens).tolist() == engine_held


def test_empty_requests_spread_over_ranks():
    """The tie the engine and the cost model used to break differently: 8 empty histories on
    4 ranks go two to a rank, in both."""
    reqs, alloc = _running("tp", [0] * 8, 4)
    m = build_manifest(LAYOUTS["tp"], LAYOUTS["dp"], reqs, alloc, 4, PS, 8)
    assert m is not None
    assert sorted(m.new_owners.values()) == [0, 0, 1, 1, 2, 2, 3, 3]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_vectorised_answers_match_the_page_rule(layout):
    """Held pages, held tokens, slots' holders and local indices, per request, equal what the
    per-page rule (`page_holders`, `local_page_index`) gives page by page."""
    lay, world = LAYOUTS[layout], 4
    rng = np.random.default_rng(0)
    ctx = rng.integers(0, 200, size=40)
    owners = rng.integers(0, world, size=40)
    for rank in range(world):
        pages = num_local_pages(lay, -(-ctx // PS), rank, owners, world)
        tokens = local_kv_len(lay, ctx, rank, owners, world, PS)
        for b in range(len(ctx)):
            held = [i for i in range(-(-int(ctx[b]) // PS))
                    if rank in page_holders(lay, i, int(owners[b]), world)]
            assert pages[b] == len(held)
            assert tokens[b] == sum(min(PS, int(ctx[b]) - i * PS) for i in held)
            logical = np.arange(-(-int(ctx[b]) // PS))
            own = np.full(len(logical), owners[b])
            assert holds(lay, rank, logical, own, world).tolist() == [i in held for i in logical]
            assert holders(lay, logical, own, world)[:, rank].tolist() == \
                [i in held for i in logical]
            assert sorted(local_page_index(lay, np.array(held, dtype=np.int64), world).tolist()) \
                == list(range(len(held)))


def test_cp_gather_map_covers_every_row_once():
    ctx, world = [0, 5, 16, 37, 100], 3
    g = cp_gather_map(ctx, world, PS)
    assert sum(g.counts) == sum(ctx)
    got = sorted(zip(g.request.tolist(), g.position.tolist()))
    assert got == [(b, p) for b, n in enumerate(ctx) for p in range(n)]
    for p, r, k in zip(g.position.tolist(), g.rank.tolist(), g.local_row.tolist()):
        assert page_holders(LAYOUTS["cp"], p // PS, 0, world) == (r,)
        # the k-th row rank r holds: local page k // PS, offset k % PS
        assert (local_page_index(LAYOUTS["cp"], p // PS, world), p % PS) == divmod(k, PS)
