"""The decision audit: what the policy weighed (candidate, predicted gain and cost, why it
declined) and the realized gain of a switch from measured step times around it."""

from __future__ import annotations

import pytest

from splash.backends.profiles import PROFILES
from splash.model.config import ModelConfig
from splash.model.presets import preset_config
from splash.planning.audit import DecisionAudit
from splash.planning.cost_model import BatchShape, CostModel
from splash.planning.policy import Decision, LayoutPolicy

GIB = 1 << 30
PER_ROW = {"tp": 2.0, "dp": 1.0}  # predicted ms per row


def per_row_cost(layout: str, batch: BatchShape) -> float:
    return PER_ROW[layout] * batch.num_rows


def switch_to(dst: str, gain: float = 3.0, cost: float = 5.0) -> Decision:
    return Decision(dst, True, "faster", {"tp": 8.0, "dp": 5.0}, cost, {}, dst, gain, cost,
                    "switch")


def decline(kind: str, gain: float = 1.0) -> Decision:
    return Decision("tp", False, f"declined: {kind}", {"tp": 8.0, "dp": 7.0}, 0.0, {}, "dp",
                    gain, 4.0, kind)


def test_realized_gain_uses_measured_steps_on_both_sides() -> None:
    audit = DecisionAudit(per_row_cost, window=3)
    # in tp the steps run 1.5x slower than predicted: f = 1.5
    for step, rows in enumerate((4, 4, 6)):
        audit.observe(step, "tp", BatchShape.decode(rows, 100), 1.5 * 2.0 * rows)
    entry = audit.record(3, "tp", switch_to("dp"), horizon_steps=40)
    assert entry is not None and entry["realized_gain_ms"] is None
    assert audit.observe(3, "dp", BatchShape.decode(6, 101), 99.0, switching=True) == []
    measured = {4: (6, 7.0), 5: (6, 8.0), 6: (5, 6.0)}  # step: (rows, ms) in dp
    done = []
    for step, (rows, ms) in measured.items():
        done += audit.observe(step, "dp", BatchShape.decode(rows, 102), ms)
    assert done == [entry]
    # staying in tp: 1.5 * 2 ms per row -> 18, 18, 15; gains 11, 10, 9 -> median 10
    assert entry["realized_gain_ms"] == pytest.approx(10.0)
    assert entry["realized_steps"] == 3 and entry["estimated_stay_ms"] == pytest.approx(18.0)
    assert entry["measured_over_predicted_before"] == pytest.approx(1.5)
    assert entry["predicted_gain_ms"] == 3.0 and entry["predicted_switch_ms"] == 5.0


def test_switching_away_early_closes_the_window() -> None:
    audit = DecisionAudit(per_row_cost, window=8)
    audit.observe(0, "tp", BatchShape.decode(2, 10), 4.0)
    entry = audit.record(1, "tp", switch_to("dp"), 10)
    audit.observe(1, "dp", BatchShape.decode(2, 11), 9.0, switching=True)
    audit.observe(2, "dp", BatchShape.decode(2, 12), 1.0)
    assert entry is not None and entry["realized_gain_ms"] is None
    done = audit.observe(3, "tp", BatchShape.decode(2, 13), 50.0, switching=True)  # back
    assert done == [entry] and entry["realized_steps"] == 1
    assert entry["realized_gain_ms"] == pytest.approx(4.0 - 1.0)


def test_declines_coalesce_and_have_no_realized_gain() -> None:
    audit = DecisionAudit(per_row_cost)
    assert audit.record(0, "tp", Decision("tp", False, "tp is best", {"tp": 1.0}), 5) is None
    first = audit.record(1, "tp", decline("margin", gain=0.5), 5)
    assert first is not None and first["kind"] == "margin" and "realized_gain_ms" not in first
    assert audit.record(2, "tp", decline("margin", gain=0.8), 5) is None  # same: one entry
    assert audit.record(3, "tp", decline("dwell"), 5) is not None
    assert [e["kind"] for e in audit.entries] == ["margin", "dwell"]
    assert first["count"] == 2 and first["last_step"] == 2 and first["predicted_gain_ms"] == 0.8


@pytest.fixture(scope="module")
def cm() -> CostModel:
    return CostModel(ModelConfig.from_hf(preset_config("deepseek-v3", scale="full")), 8,
                     PROFILES["h200"], "fp8", "bf16")


def test_policy_decisions_say_what_was_weighed(cm: CostModel) -> None:
    costs = {"tp": 10.0, "dp": 5.0, "cp": 10.5, "dop": 9.0}
    pol = LayoutPolicy(cm, None, int(120 * GIB), margin=0.1, min_dwell_steps=2,
                       layouts=["tp", "dp", "cp", "dop"], smoothing=1.0,
                       cost_fn=lambda n, b: costs[n], switch_cost_fn=lambda *a: 7.0)
    batch = BatchShape.decode(8, 1000)
    d = pol.decide("tp", batch, expected_remaining_steps=100)
    assert d.switch and d.kind == "switch" and d.candidate == "dp"
    assert d.gain_ms == pytest.approx(5.0) and d.candidate_cost_ms == 7.0
    d = pol.decide("dp", batch, 100)
    assert not d.switch and d.candidate is None and d.kind == "stay"
    costs["dop"] = 2.0  # dop now leads dp, but the dwell holds
    d = pol.decide("dp", batch, 100)
    assert (d.kind, d.candidate, d.gain_ms) == ("dwell", "dop", pytest.approx(3.0))
    d = pol.decide("dp", batch, 1)  # dwell over; 3 ms x 1 step < 7 ms switch
    assert (d.kind, d.candidate, d.candidate_cost_ms) == ("economics", "dop", 7.0)
    costs["dop"] = 4.8  # 4% lead < 10% margin
    assert pol.decide("dp", batch, 100).kind == "margin"


def test_switch_before_any_step_uses_the_model_for_staying() -> None:
    audit = DecisionAudit(per_row_cost, window=2)
    entry = audit.record(0, "tp", switch_to("dp"), 10)  # an idle engine chose for the arrivals
    audit.observe(0, "dp", BatchShape((), ((8, 0),)), 30.0, switching=True)
    audit.observe(1, "dp", BatchShape.decode(4, 9), 5.0)
    audit.observe(2, "dp", BatchShape.decode(4, 10), 3.0)
    assert entry is not None and entry["stay_basis"] == "model"
    assert entry["realized_gain_ms"] == pytest.approx(8.0 - 4.0)  # tp: 2 ms x 4 rows, f = 1
