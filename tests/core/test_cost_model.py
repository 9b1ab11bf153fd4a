"""Cost model: the ownership model's accounting, growth with context, collectives per layout, switch bytes."""

from __future__ import annotations

import dataclasses

import pytest

from splash.backends.profiles import PROFILES
from splash.core.ownership import assign_owners
from splash.model.config import ModelConfig
from splash.model.presets import preset_config
from splash.planning.cost_model import BatchShape, CostModel

MIB = 1 << 20
LAYOUTS = ("tp", "dp", "cp", "dop")


@pytest.fixture(scope="module")
def v3() -> ModelConfig:
    return ModelConfig.from_hf(preset_config("deepseek-v3", scale="full"))


@pytest.fixture(scope="module")
def cm(v3: ModelConfig) -> CostModel:
    return CostModel(v3, 8, PROFILES["h200"], "bf16", "bf16")


def test_design_accounting(cm: CostModel) -> None:
    assert cm.memory.projection_bytes_per_layer == 328 * MIB
    assert cm.memory.weight_allgather_bytes_per_rank_per_layer == 287 * MIB
    assert cm.kv_bytes_per_token_per_layer == 1152  # dense MLA: no indexer bytes


def test_batch_shape_validates() -> None:
    with pytest.raises(ValueError):
        BatchShape(decode_ctx=[0])
    with pytest.raises(ValueError):
        BatchShape(prefill=[(0, 5)])
    with pytest.raises(ValueError):
        BatchShape(decode_ctx=[3, 4], owners=[0])
    b = BatchShape(decode_ctx=[10, 20], prefill=[(8, 100)])
    assert b.num_rows == 10 and b.num_requests == 3
    assert list(b.tokens_after()) == [10, 20, 108]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cost_grows_with_context_and_batch(cm: CostModel, layout: str) -> None:
    times = [cm.step_time_ms(layout, BatchShape.decode(16, ctx)) for ctx in (1024, 16384, 131072)]
    assert times[0] < times[1] < times[2]
    assert cm.step_time_ms(layout, BatchShape.decode(64, 16384)) > times[1]
    pf = [cm.step_time_ms(layout, BatchShape(prefill=[(2048, p)] * 8)) for p in (0, 32768)]
    assert pf[0] < pf[1]


def test_collectives_per_layer(cm: CostModel) -> None:
    layers = cm.cfg.num_hidden_layers
    counts = {n: cm.breakdown(n, BatchShape.decode(16, 4096))["collectives"] for n in LAYOUTS}
    # MLP all-reduce everywhere, plus: TP all-reduce, DP row all-gather, CP (o, lse)
    # all-gather, DOP two all-to-alls and an all-reduce
    assert counts == {"tp": 2 * layers, "dp": 2 * layers, "cp": 2 * layers, "dop": 4 * layers}
    single = CostModel(cm.cfg, 1, cm.profile)
    assert single.breakdown("dop", BatchShape.decode(4, 4096))["collectives"] == 0


def test_dop_exchange_independent_of_context(cm: CostModel) -> None:
    short = cm.breakdown("dop", BatchShape.decode(16, 4096))["comm_bytes_per_rank"]
    long = cm.breakdown("dop", BatchShape.decode(16, 131072))["comm_bytes_per_rank"]
    assert short == long > 0


def test_tp_reads_whole_history_dp_reads_owned(cm: CostModel) -> None:
    b = BatchShape.decode(64, 131072)
    att = {n: cm.breakdown(n, b)["attention"] for n in LAYOUTS}
    assert att["tp"] > 4 * att["dp"]  # replicated KV read on every rank
    assert att["dp"] == pytest.approx(att["dop"])  # same owner-side attention


def test_owner_imbalance_is_modelled(cm: CostModel) -> None:
    ctx = (131072,) * 8
    balanced = cm.step_time_ms("dp", BatchShape(decode_ctx=ctx, owners=range(8)))
    skewed = cm.step_time_ms("dp", BatchShape(decode_ctx=ctx, owners=[0] * 8))
    assert skewed > balanced
    # one long request: CP spreads its positions, an owned layout cannot
    one = BatchShape.decode(1, 262144)
    assert cm.breakdown("cp", one)["attention"] < cm.breakdown("dp", one)["attention"] / 4


def test_assign_owners_balances() -> None:
    owners = assign_owners([100, 90, 10, 10, 5, 5, 0, 0], 4)
    load = [0] * 4
    for t, o in zip([100, 90, 10, 10, 5, 5, 0, 0], owners):
        load[o] += t
    assert max(load) == 100 and sorted(owners[:2]) == [0, 1]
    assert len(set(assign_owners([0] * 8, 4))) == 4  # ties spread by count


def test_switch_bytes_follow_the_switch_table(cm: CostModel) -> None:
    b = BatchShape.decode(16, 65537)  # 65,536 live tokens per request
    live = 16 * 65536
    kvb = cm.kv_bytes_per_token_per_layer
    for src, dst in (("tp", "dop"), ("dp", "dop"), ("cp", "dp"), ("tp", "cp")):
        sc = cm.switch_cost(src, dst, b)
        assert ("kv all-to-all" in sc.primitives) == (src == "cp")
    assert cm.switch_cost("tp", "dop", b).primitives == ()  # pure discards
    assert cm.switch_cost_ms("dp", "dop", b) == 0.0
    w = cm.switch_cost("dop", "dp", b)
    assert w.primitives == ("weight all-gather",)
    assert w.weight_bytes_per_rank_per_layer == 287 * MIB and w.kv_bytes_per_rank_per_layer == 0
    g = cm.switch_cost("dp", "tp", b)  # each rank gathers the 7/8 it lacks
    assert g.primitives == ("kv all-gather",)
    assert g.kv_bytes_per_rank_per_layer == live * 7 // 8 * kvb
    a = cm.switch_cost("cp", "dop", b)  # (T-1)/T of each rank's share moves
    assert a.kv_bytes_per_rank_per_layer == pytest.approx(live / 8 * 7 / 8 * kvb, rel=0.01)
    assert 0 < g.live_ms <= g.blocking_ms
    assert g.blocking_ms == pytest.approx(g.transfer_ms_per_layer * cm.cfg.num_hidden_layers)


def test_live_switch_hides_behind_compute(cm: CostModel) -> None:
    b = BatchShape(prefill=[(8192, 65536)] * 4)  # long compute per layer
    sc = cm.switch_cost("tp", "dp", b)
    assert sc.live_ms == pytest.approx(sc.transfer_ms_per_layer)  # only the first layer shows
    assert sc.live_ms < sc.blocking_ms / 10


def test_overlap_fraction_hides_communication(cm: CostModel) -> None:
    b = BatchShape(prefill=[(4096, 65536)] * 8)
    none = dataclasses.replace(cm.profile, overlap_fraction=0.0)
    full = dataclasses.replace(cm.profile, overlap_fraction=1.0)
    t0 = CostModel(cm.cfg, 8, none).step_time_ms("cp", b)
    t1 = CostModel(cm.cfg, 8, full).step_time_ms("cp", b)
    assert t1 < t0


def test_dsa_models_pay_indexer_and_topk(cm: CostModel) -> None:
    glm = ModelConfig.from_hf(preset_config("glm-5", scale="full"))
    sparse = CostModel(glm, 8, PROFILES["b200"], "fp8", "fp8")
    dense = CostModel(glm, 8, PROFILES["b200"], "fp8", "fp8", sparse_attention=False)
    assert sparse.kv_bytes_per_token_per_layer == dense.kv_bytes_per_token_per_layer + 132
    b = BatchShape.decode(16, 262144)
    assert sparse.breakdown("dp", b)["attention"] < dense.breakdown("dp", b)["attention"]


def test_prefill_chunks_priced_in_the_form_the_engine_runs(v3: ModelConfig) -> None:
    """At T=1 every layout places the same heads and rows, so attention differs only by form:
    DOP stays absorbed; TP, DP and CP run a long chunk expanded (the engine's choice,
    ``splash.layouts.expanded``) and pay less; decode rows and a short chunk over a long
    history stay absorbed everywhere, at the same price."""
    from splash.core.mla_forms import expanded_wins

    cm1 = CostModel(v3, 1, PROFILES["h200"], "bf16", "bf16")

    def attention(layout: str, batch: BatchShape) -> float:
        return cm1.breakdown(layout, batch)["attention"]

    long_chunk = BatchShape(prefill=[(8192, 0)])
    short_chunk = BatchShape(prefill=[(16, 8192)], decode_ctx=[4096] * 8)
    assert expanded_wins(v3, [8192], [8192]) and not expanded_wins(v3, [16], [8208])
    for layout in ("tp", "dp", "cp"):
        assert attention(layout, long_chunk) < 0.5 * attention("dop", long_chunk)
        for batch in (BatchShape.decode(16, 8192), short_chunk):
            assert attention(layout, batch) == pytest.approx(attention("dop", batch))
