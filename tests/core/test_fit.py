"""Fitting the cost model to measured steps: NNLS against brute force, recovery of known
profile fields from steps the cost model itself produced, and the error table."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from splash.backends.profiles import PROFILES
from splash.model.config import ModelConfig
from splash.model.presets import preset_config
from splash.planning.cost_model import BatchShape, CostModel
from splash.planning.fit import (
    StepPoint,
    SwitchPoint,
    error_table,
    fit_profile,
    neutral,
    nnls,
    predict_switch,
)


def brute_nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Every subset of free variables, unconstrained least squares, best feasible one."""
    best, best_x = np.inf, np.zeros(a.shape[1])
    for k in range(a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), k):
            x = np.zeros(a.shape[1])
            if cols:
                x[list(cols)] = np.linalg.lstsq(a[:, list(cols)], b, rcond=None)[0]
            if (x >= -1e-12).all() and np.sum((a @ x - b) ** 2) < best - 1e-12:
                best, best_x = np.sum((a @ x - b) ** 2), x
    return best_x


@pytest.mark.parametrize("seed", range(6))
def test_nnls_matches_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    a, b = rng.normal(size=(12, 4)), rng.normal(size=12)
    x = nnls(a, b)
    assert (x >= 0).all()
    np.testing.assert_allclose(x, brute_nnls(a, b), atol=1e-8)


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    c = preset_config("deepseek-v3", scale="full")
    c.update(num_hidden_layers=8, n_routed_experts=32, first_k_dense_replace=1)
    return ModelConfig.from_hf(c)


def _points(cm: CostModel, noise: float = 0.0, seed: int = 0) -> list[StepPoint]:
    rng = np.random.default_rng(seed)
    pts = []
    for layout in ("tp", "dp", "cp", "dop"):
        for b, ctx in ((1, 1000), (8, 4000), (32, 2000), (64, 480), (16, 7000)):
            batch = BatchShape.decode(b, ctx)
            pts.append(StepPoint(layout, batch, cm.step_time_ms(layout, batch)
                                 * (1 + noise * rng.normal())))
        chunk = BatchShape((), ((2048, 0),))
        pts.append(StepPoint(layout, chunk, cm.step_time_ms(layout, chunk), "prefill"))
    return pts


def test_fit_recovers_the_profile_that_made_the_steps(cfg: ModelConfig) -> None:
    base = PROFILES["h200"]
    true = dataclasses.replace(base, gemm_time_scale=1.8, attention_time_scale=2.5,
                               collective_latency_us=35.0, step_overhead_us=900.0,
                               request_overhead_us=40.0,
                               switch_time_scale=1.6, switch_overhead_us=1500.0)
    truth = CostModel(cfg, 2, true, sparse_attention=False)
    steps = _points(truth)
    live = (1000, 4000, 2000)
    switches = [SwitchPoint(s, d, BatchShape.decode(3, 2001), live, None,
                            predict_switch(truth, SwitchPoint(s, d, BatchShape.decode(3, 2001),
                                                              live, None, 1.0)))
                for s, d in (("tp", "dp"), ("dp", "cp"), ("cp", "dop"), ("dop", "tp"),
                             ("dp", "dop"))]
    # a first switch that also connected its NCCL peers: far above its twin, left out
    switches.append(dataclasses.replace(switches[1], measured_ms=40 * switches[1].measured_ms))
    fitted = fit_profile(cfg, 2, base, steps, switches)
    for name in ("gemm_time_scale", "attention_time_scale", "collective_latency_us",
                 "step_overhead_us", "request_overhead_us", "switch_time_scale",
                 "switch_overhead_us"):
        assert getattr(fitted, name) == pytest.approx(getattr(true, name), rel=1e-3), name
    assert fitted.hbm_gbps == base.hbm_gbps and fitted.link_gbps == base.link_gbps


def test_fitted_error_is_never_above_the_unfitted(cfg: ModelConfig) -> None:
    true = dataclasses.replace(PROFILES["h200"], gemm_time_scale=1.3, step_overhead_us=3000.0)
    steps = _points(CostModel(cfg, 2, true, sparse_attention=False), noise=0.2, seed=3)
    base = PROFILES["h200"]
    fitted = fit_profile(cfg, 2, base, steps)
    table = error_table(cfg, 2, {"roofline": neutral(base), "fitted": fitted}, steps)
    s = table["summary"]
    assert s["fitted"]["step"]["rms"] <= s["roofline"]["step"]["rms"]
    assert s["fitted"]["step"]["rms"] < 0.5 and s["fitted"]["step"]["points"] == len(steps)
    row = table["steps"][0]
    assert row["fitted_err"] == pytest.approx(row["fitted_ms"] / row["measured_ms"] - 1,
                                              abs=1e-3)
    assert s["fitted"]["switch"] is None  # no switches measured


def test_fit_needs_points(cfg: ModelConfig) -> None:
    with pytest.raises(ValueError, match="no measured steps"):
        fit_profile(cfg, 2, PROFILES["h200"], [])
