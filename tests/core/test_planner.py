"""`splash plan`: DeepSeek-V3 memory numbers, JSON keys, switch volumes, capacity order at paper scale."""

from __future__ import annotations

import argparse
import json

import pytest

from splash.errors import ConfigError
from splash.planning.planner import plan, plan_main

MIB = 1 << 20


@pytest.fixture(scope="module")
def v3_plan() -> dict:
    return plan("deepseek-v3", "h200", 8, batch=16, input_len=4096)


def test_design_numbers_for_deepseek_v3(v3_plan: dict) -> None:
    assert v3_plan["projection_bytes_per_layer"] == 328 * MIB
    assert v3_plan["weight_allgather_bytes_per_rank_per_layer"] == 287 * MIB
    assert v3_plan["kv_bytes_per_token_per_layer"] == 1152
    assert v3_plan["projection_mib_per_layer"] == 328.0
    assert v3_plan["weight_allgather_mib_per_rank_per_layer"] == 287.0


def test_plan_keys_and_layouts(v3_plan: dict) -> None:
    for key in ("layouts", "chosen", "switches", "budget_bytes_per_rank", "common_bytes_per_rank"):
        assert key in v3_plan
    assert set(v3_plan["layouts"]) == {"tp", "dp", "cp", "dop"}
    for lay in v3_plan["layouts"].values():
        assert {"per_rank_bytes", "kv_capacity_tokens", "step_time_ms", "feasible"} <= set(lay)
    sw = v3_plan["switches"]
    assert len(sw) == 12
    assert sw["tp->dop"]["primitives"] == ["discard"]
    assert sw["dop->dp"]["weight_bytes_per_rank_per_layer"] == 287 * MIB
    assert sw["dp->tp"]["primitives"] == ["kv all-gather"]
    assert sw["dp->cp"]["primitives"] == ["kv all-to-all"]
    primitives = [p for s in sw.values() for p in s["primitives"]]
    assert primitives.count("kv all-gather") == 3 and primitives.count("kv all-to-all") == 4
    assert primitives.count("weight all-gather") == 4
    # only entering DOP from TP or DP moves nothing at all
    assert [k for k, s in sw.items() if s["primitives"] == ["discard"]] == ["tp->dop", "dp->dop"]


def test_bf16_v3_does_not_fit_h200_but_fp8_does(v3_plan: dict) -> None:
    """An infeasible plan chooses nothing, says why and which change would fit."""
    assert not any(lay["feasible"] for lay in v3_plan["layouts"].values())
    assert v3_plan["chosen"] is None
    assert "weights" in v3_plan["reason"] and "--weight-dtype fp8 would fit" in v3_plan["reason"]
    fp8 = plan("deepseek-v3", "h200", 8, 16, 4096, weight_dtype="fp8", kv_dtype="bf16")
    assert fp8["layouts"]["dop"]["feasible"] and fp8["layouts"]["tp"]["feasible"]
    assert fp8["layouts"][fp8["chosen"]]["feasible"]


def test_kimi_k2_on_eight_h200s_needs_a_larger_memory_fraction() -> None:
    """Where the same ranks hold the weights with a larger share of their memory, the plan says
    so before asking for more ranks, and at that fraction a layout is chosen."""
    p = plan("kimi-k2", "h200", 8, 16, 4096, weight_dtype="fp8", kv_dtype="fp8",
             memory_fraction=0.85)
    assert p["chosen"] is None
    assert "--memory-fraction 0.95 would fit" in p["reason"] and "--tp" not in p["reason"]
    more = plan("kimi-k2", "h200", 8, 16, 4096, weight_dtype="fp8", kv_dtype="fp8",
                memory_fraction=0.95)
    assert more["chosen"] and more["layouts"][more["chosen"]]["feasible"]
    half = plan("kimi-k2", "h200", 4, 16, 4096, weight_dtype="fp8", kv_dtype="fp8",
                memory_fraction=0.95)  # already at that fraction: more ranks
    assert half["chosen"] is None and "; --tp 8 would fit" in half["reason"]


def test_glm5_capacity_order_on_b200() -> None:
    p = plan("glm-5", "b200", 8, 16, 524288, weight_dtype="fp8", kv_dtype="fp8")
    cap = {n: lay["kv_capacity_tokens"] for n, lay in p["layouts"].items()}
    assert cap["dop"] > cap["dp"] > cap["tp"] and cap["dop"] > cap["cp"]
    res = {n: lay["max_resident_requests"] for n, lay in p["layouts"].items()}
    assert res["dop"] == 16 > res["cp"] > res["dp"]  # owners cannot split a request
    assert p["aux_kv_bytes_per_token_per_layer"] == 132  # DSA indexer key + scale


def test_plan_main_json_and_table(capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(model="deepseek-v2-lite", hardware="h200", tp_size=4, batch=8,
                              input_len=2048, memory_fraction=0.85, kv_dtype="bf16",
                              weight_dtype="bf16", json=True)
    assert plan_main(args) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    obj = json.loads(out[0])
    assert obj["tp"] == 4 and obj["chosen"] in obj["layouts"]
    args.json = False
    assert plan_main(args) == 0
    text = capsys.readouterr().out
    assert "chosen:" in text and "dop" in text and "switch" in text


def test_unknown_model_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        plan("no-such-model", "h200", 8)
    with pytest.raises(ConfigError):
        plan("deepseek-v3", "tpu", 8)
