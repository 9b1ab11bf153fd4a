"""The ownership model's accounting pinned to DeepSeek-V3's published sizes and the capacity order
of the layouts at equal memory."""

from __future__ import annotations

import pytest

from splash.core.memory import MemoryModel
from splash.core.ownership import LAYOUTS
from splash.model.config import ModelConfig
from splash.model.presets import preset_config

MIB = 2**20


@pytest.fixture(scope="module")
def v3():
    return ModelConfig.from_hf(preset_config("deepseek-v3", scale="full"))


def test_deepseek_v3_projection_accounting(v3):
    m = MemoryModel(v3, world=8, weight_dtype="bf16", kv_dtype="bf16")
    assert m.projection_bytes_per_layer == 328 * MIB
    assert m.weight_allgather_bytes_per_rank_per_layer == 287 * MIB
    assert m.kv_bytes_per_token_per_layer == 1152


@pytest.mark.parametrize("world", [2, 4, 8])
def test_capacity_order_at_equal_memory(v3, world):
    m = MemoryModel(v3, world=world, weight_dtype="fp8", kv_dtype="fp8")
    budget = m.static_bytes_per_rank(LAYOUTS["dp"]) + 8 * 2**30  # 8 GiB KV room under DP
    cap = m.capacity_report(budget)
    assert cap["dop"] >= cap["cp"] and cap["dop"] > cap["dp"]
    assert cap["dp"] > cap["tp"]
    # DOP's extra room is exactly the replicas it does not keep
    extra = m.projection_bytes_per_rank(LAYOUTS["dp"]) - m.projection_bytes_per_rank(LAYOUTS["dop"])
    assert cap["dop"] - cap["dp"] == pytest.approx(extra / m.kv_bytes_per_token * world,
                                                   abs=world * m.page_size)
