"""KV pool sizing at start-up (splash/engine/memory_plan.py, splash/engine/setup.py), without
workers: pages are what the budget leaves after the weights, the activation reserve and the
graph reserve; a configuration that cannot fit is refused before any worker starts, naming the
knob to change; the workers' measurements replace the estimates where they are larger."""

from __future__ import annotations

import msgspec
import pytest
from tiny_models import checkpoint

from splash.core.memory import MemoryModel
from splash.core.ownership import LAYOUTS
from splash.core.protocol import WorkerProfile
from splash.engine.config import EngineConfig
from splash.engine.memory_plan import GIB, MemoryBudget
from splash.engine.setup import resolve_setup, size_from_profiles
from splash.errors import ConfigError

MIB = 2**20


def _setup(**kw):
    return resolve_setup(EngineConfig(checkpoint("v3"), backend="cpu", page_size=4, **kw))


def test_pages_are_what_the_budget_leaves():
    b = MemoryBudget(budget=10 * GIB, weights=3 * GIB, activations=GIB, graphs=GIB // 2,
                     page_bytes=3 * MIB)
    assert b.pages() == (10 * GIB - 3 * GIB - GIB - GIB // 2) // (3 * MIB)
    assert b.pages() * b.page_bytes <= b.kv_bytes < (b.pages() + 1) * b.page_bytes


@pytest.mark.parametrize("world", [1, 2])
def test_weights_count_every_projection_placement_a_rank_may_hold(world):
    """At T=2 a switch to DP/CP places every head on every rank: the pool is sized with the
    replicated projections counted (not lent to KV, which the device could not give back)."""
    setup = _setup(tp_size=world, layout="tp")
    mem = MemoryModel(setup.model_cfg, world, "fp32", "fp32", 4)
    c = setup.model_cfg
    heads = c.num_attention_heads
    q_in = c.q_lora_rank or c.hidden_size
    all_heads = c.num_hidden_layers * 4 * heads * (
        q_in * (c.qk_nope_head_dim + c.qk_rope_head_dim)
        + c.kv_lora_rank * (c.qk_nope_head_dim + c.v_head_dim) + c.v_head_dim * c.hidden_size)
    assert setup.budget.weights == mem.common_bytes_per_rank + all_heads
    assert setup.kv_capacity_tokens()["tp"] == setup.num_pages * 4
    if world == 2:
        assert setup.kv_capacity_tokens()["dp"] == 2 * setup.num_pages * 4


def test_measured_profiles_size_the_pool():
    """The largest rank's measured weights (plus the heads it may still receive) and its
    activation peak, when above the estimate, set the pool."""
    setup = _setup(tp_size=2, layout="tp")
    budget, est = setup.budget, setup.budget.activations
    page = setup.memory.page_bytes
    extra = setup.memory.projection_bytes_per_rank(LAYOUTS["dp"]) - \
        setup.memory.projection_bytes_per_rank(LAYOUTS["tp"])
    weights = budget.budget - est - extra - 100 * page - 7  # leaves 100 whole pages ...
    peak = est + page  # ... and a measured peak one page above the estimate takes one
    profiles = [WorkerProfile(0, 1, "cpu", weights - 10, peak - 5),
                WorkerProfile(1, 2, "cpu", weights, peak)]
    sized = size_from_profiles(setup, profiles)
    assert sized.budget.weights == weights + extra
    assert sized.budget.activations == peak and sized.budget.measured
    assert sized.num_pages == 99 == (budget.budget - weights - extra - peak) // page
    assert sized.max_request_tokens == 99 * 4
    low = size_from_profiles(setup, [msgspec.structs.replace(p, activation_bytes=1)
                                     for p in profiles])
    assert low.budget.activations == est  # never below the estimate


def test_resident_projections_count_both_placements_once():
    """Resident projections: the estimate counts the sharded and the replicated heads (as under
    CUDA graphs), and the workers' measurement, which then holds both already, is taken as
    it is (the heads a rank may still receive are not added on top)."""
    plain = _setup(tp_size=2, layout="tp", resident_projections=False)
    setup = _setup(tp_size=2, layout="tp", resident_projections=True)
    assert setup.resident_heads and not plain.resident_heads
    assert not _setup(tp_size=1, resident_projections=True).resident_heads  # one placement
    mem = setup.memory
    sharded, full = (mem.projection_bytes_per_rank(LAYOUTS[n]) for n in ("tp", "dp"))
    assert setup.budget.weights - plain.budget.weights == sharded  # both, not the larger one
    measured = setup.budget.weights  # what a worker holding both placements reports
    sized = size_from_profiles(setup, [WorkerProfile(r, r + 1, "cpu", measured, 0)
                                       for r in range(2)])
    assert sized.budget.weights == measured
    assert full > sharded


def test_profiling_out_of_memory_refuses_naming_the_chunk():
    setup = _setup()
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        size_from_profiles(setup, [WorkerProfile(0, 1, "cuda:0", error="OutOfMemoryError: x",
                                                 oom=True)])


def test_huge_prefill_chunk_is_refused_at_start():
    """The issue's case: a chunk whose activations cannot fit is refused before any worker
    starts (not accepted and then out of memory mid-serving)."""
    with pytest.raises(ConfigError, match="lower max_num_batched_tokens"):
        _setup(max_num_batched_tokens=1 << 30)


def test_weights_that_leave_nothing_name_memory_fraction():
    with pytest.raises(ConfigError, match="raise memory_fraction or tp_size"):
        _setup(memory_fraction=1e-9)


def test_refusals_name_their_knob():
    page = MIB
    graphs = MemoryBudget(budget=4 * GIB, weights=GIB, activations=GIB // 4, graphs=3 * GIB,
                          page_bytes=page)
    with pytest.raises(ConfigError, match="max_num_seqs"):
        graphs.check(graphs.pages(), explicit=False)
    room = MemoryBudget(budget=4 * GIB, weights=GIB, activations=GIB, graphs=0, page_bytes=page)
    room.check(room.pages(), explicit=True)  # exactly what is left: accepted
    with pytest.raises(ConfigError, match="lower kv_pages_per_rank to at most 2048"):
        room.check(room.pages() + 1, explicit=True)


def test_the_reserve_covers_the_expanded_prefill_at_any_context(monkeypatch):
    """Run expanded, a prefill chunk gathers its whole history (and a dequantised copy) beside
    at most ``EXPANDED_BUDGET`` bytes of expanded keys and values: past the profiling steps'
    context that grows with the context, so the analytic reserve counts it, at DeepSeek-V3's
    dims; with ``SPLASH_MHA_PREFILL=off`` nothing is added."""
    from splash.engine.memory_plan import StepLimits, activation_estimate
    from splash.layouts.expanded import EXPANDED_BUDGET
    from splash.model.config import ModelConfig
    from splash.model.presets import preset_config

    v3 = ModelConfig.from_hf(preset_config("deepseek-v3", scale="full"))

    def reserve(context: int) -> int:
        return activation_estimate(v3, 1, "bf16", StepLimits(2048, 64, 64, context))

    monkeypatch.setenv("SPLASH_MHA_PREFILL", "off")
    off = {c: reserve(c) for c in (16384, 131072)}
    monkeypatch.setenv("SPLASH_MHA_PREFILL", "auto")
    on = {c: reserve(c) for c in (16384, 131072)}
    rows = 2 * 2 * (512 + 64)  # bf16 latent rows, gathered and dequantised, per history token
    assert on[131072] - off[131072] == EXPANDED_BUDGET + 131072 * rows
    assert on[131072] - on[16384] - (off[131072] - off[16384]) == (131072 - 16384) * rows
