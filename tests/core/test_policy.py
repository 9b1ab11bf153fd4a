"""Feasibility and the layout policy: capacity order, hysteresis, economics, admission."""

from __future__ import annotations

import pytest

from splash.backends.profiles import PROFILES
from splash.core.ownership import get_layout
from splash.model.config import ModelConfig
from splash.model.presets import preset_config
from splash.planning.cost_model import BatchShape, CostModel
from splash.planning.feasibility import Feasibility
from splash.planning.policy import LayoutPolicy, build_policy

GIB = 1 << 30


@pytest.fixture(scope="module")
def cm() -> CostModel:
    cfg = ModelConfig.from_hf(preset_config("deepseek-v3", scale="full"))
    return CostModel(cfg, 8, PROFILES["h200"], "fp8", "bf16")


@pytest.fixture(scope="module")
def budget(cm: CostModel) -> int:
    return int(0.85 * PROFILES["h200"].memory_gib * GIB)


def fixed_costs(costs: dict[str, float]):
    return lambda layout, batch: costs[layout]


def no_switch_cost(*_args) -> float:
    return 1.0


def test_capacity_order(cm: CostModel, budget: int) -> None:
    feas = Feasibility(cm.memory, reserve_bytes=2 * GIB)
    cap = {n: feas.kv_capacity_tokens(n, budget) for n in ("tp", "dp", "cp", "dop")}
    assert cap["dop"] > cap["dp"] > cap["tp"] > 0
    assert cap["dop"] >= cap["cp"] and cap["cp"] == cap["dp"]
    assert cap["dop"] == 8 * cap["tp"]  # same projections, KV held once instead of T times
    assert cap == {n: cm.memory.kv_capacity_tokens(get_layout(n), budget, 2 * GIB)
                   for n in cap}  # agrees with MemoryModel when there is no aux state


def test_feasible_counts_pages_per_rank(cm: CostModel, budget: int) -> None:
    feas = Feasibility(cm.memory)
    per_rank = feas.kv_capacity_tokens("dop", budget) // 8
    two = [per_rank // 2 + 64] * 2  # two requests that each need over half a rank
    assert feas.feasible("cp", two, budget)  # pages spread over ranks
    assert not feas.feasible("dop", two, budget, owners=[0, 0])
    assert feas.feasible("dop", two, budget)  # greedy owners put them apart
    assert feas.switch_buffer_bytes("dop", "dp", two) == cm.memory.weight_allgather_bytes_per_rank_per_layer


def test_stationary_within_margin_never_switches(cm: CostModel, budget: int) -> None:
    costs = {"tp": 10.0, "dp": 9.6, "cp": 10.3, "dop": 9.8}  # best leads by 4% < 10%
    pol = LayoutPolicy(cm, None, budget, margin=0.1, min_dwell_steps=0,
                       cost_fn=fixed_costs(costs), switch_cost_fn=no_switch_cost)
    batch = BatchShape.decode(32, 4096)
    for _ in range(100):
        d = pol.decide("tp", batch, expected_remaining_steps=10_000)
        assert not d.switch and d.layout == "tp"
    assert "within margin 10%" in d.reason
    assert pol.stats()["switches"] == 0


def test_switches_when_lead_beats_margin_and_cost(cm: CostModel, budget: int) -> None:
    costs = {"tp": 4.0, "dp": 3.6, "cp": 4.5, "dop": 3.1}
    pol = LayoutPolicy(cm, None, budget, min_dwell_steps=0, cost_fn=fixed_costs(costs),
                       switch_cost_fn=lambda *a: 12.0)
    d = pol.decide("tp", BatchShape.decode(16, 4096), expected_remaining_steps=100)
    assert d.switch and d.layout == "dop" and d.switch_cost_ms == 12.0
    assert "dop predicted 3.10 ms vs tp predicted 4.00 ms (-22%)" in d.reason
    assert "gain 90.0 ms over 100 steps > switch 12.0 ms" in d.reason
    assert set(d.predicted_ms) == {"tp", "dp", "cp", "dop"}


def test_switch_vetoed_when_too_few_steps_remain(cm: CostModel, budget: int) -> None:
    costs = {"tp": 4.0, "dp": 3.6, "cp": 4.5, "dop": 3.1}
    pol = LayoutPolicy(cm, None, budget, min_dwell_steps=0, cost_fn=fixed_costs(costs),
                       switch_cost_fn=lambda *a: 12.0)
    d = pol.decide("tp", BatchShape.decode(16, 4096), expected_remaining_steps=10)
    assert not d.switch and d.layout == "tp" and "<= switch 12.0 ms" in d.reason


def test_dwell_holds_after_a_switch(cm: CostModel, budget: int) -> None:
    costs = {"tp": 4.0, "dp": 9.0, "cp": 9.0, "dop": 3.0}
    pol = LayoutPolicy(cm, None, budget, min_dwell_steps=3, smoothing=1.0,
                       cost_fn=lambda n, b: costs[n], switch_cost_fn=no_switch_cost)
    b = BatchShape.decode(16, 4096)
    assert pol.decide("tp", b, 1e4).switch
    costs.update(tp=2.0)  # TP now leads, but the dwell holds DOP for 3 decisions
    held = [pol.decide("dop", b, 1e4) for _ in range(3)]
    assert not any(d.switch for d in held) and "dwell" in held[0].reason
    assert pol.decide("dop", b, 1e4).layout == "tp"


def test_infeasible_layout_never_chosen(cm: CostModel) -> None:
    feas = Feasibility(cm.memory)
    budget = feas.static_bytes("dp") - GIB  # replicated projections do not fit at all
    costs = {"tp": 1.0, "dp": 0.1, "cp": 0.1, "dop": 5.0}
    pol = LayoutPolicy(cm, None, budget, min_dwell_steps=0, cost_fn=fixed_costs(costs),
                       switch_cost_fn=no_switch_cost)
    room = feas.kv_capacity_tokens("dop", budget)
    tp_room = feas.kv_capacity_tokens("tp", budget)
    batch = BatchShape.decode(8, tp_room // 4)  # 2x TP's room, a quarter of DOP's
    assert room > 2 * tp_room
    for _ in range(5):
        d = pol.decide("dop", batch, 1e6)
        assert d.layout == "dop" and set(d.predicted_ms) == {"dop"}
    forced = pol.decide("tp", batch, 1.0)  # current over budget: margin and economics waived
    assert forced.switch and forced.layout == "dop" and "no longer fits" in forced.reason


def test_admission_aware_choice_prefers_dop(cm: CostModel) -> None:
    feas = Feasibility(cm.memory)
    budget = feas.static_bytes("dp") + 8 * GIB  # DP holds a few long requests, DOP many more
    fixed = {"tp": 20.0, "dp": 20.0, "cp": 20.0, "dop": 22.0}  # DOP's step is 10% slower

    def cost(layout: str, batch: BatchShape) -> float:
        return fixed[layout] + 0.1 * batch.num_rows  # weight reads dominate a decode step

    pol = LayoutPolicy(cm, None, budget, min_dwell_steps=0, cost_fn=cost,
                       switch_cost_fn=no_switch_cost)
    batch = BatchShape.decode(4, 32768)
    waiting = [32768] * 32
    plain = pol.decide("dp", batch, 1e4)
    assert not plain.switch  # without waiting requests DP is fastest
    d = pol.decide("dp", batch, 1e4, waiting_prompt_lens=waiting)
    assert d.admitted["dop"] > d.admitted["dp"]
    assert d.switch and d.layout == "dop" and "admitting" in d.reason


def test_history_is_bounded_and_stats(cm: CostModel, budget: int) -> None:
    pol = LayoutPolicy(cm, None, budget, history_len=5)
    for _ in range(12):
        pol.decide("tp", BatchShape.decode(8, 2048), 100)
    assert len(pol.history) == 5
    st = pol.stats()
    assert st["decisions"] == 5 and st["last_reason"]


def test_build_policy_from_config(budget: int) -> None:
    cfg = ModelConfig.from_hf(preset_config("deepseek-v2-lite", scale="full"))
    pol = build_policy(cfg, 4, PROFILES["h200"], budget, reserve_bytes=GIB)
    d = pol.decide("tp", BatchShape(decode_ctx=[512] * 4, prefill=[(256, 0)]), 50)
    assert d.layout in ("tp", "dp", "cp", "dop") and d.predicted_ms
    with pytest.raises(ValueError):
        LayoutPolicy(pol.cost_model, None, budget, margin=1.5)
