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


def test_dsa_pages_hold_indexer_keys():
    """V3.2 with fp8 keys: 128 + 4 B of indexer key per token per layer beside the latent row,
    in every layer; GLM-5 layers that share the previous selection store no key."""
    v32 = ModelConfig.from_hf(preset_config("deepseek-v3.2", scale="full"))
    m = MemoryModel(v32, world=8, weight_dtype="bf16", kv_dtype="bf16", index_dtype="fp8")
    assert m.index_bytes_per_token_per_layer == 132
    assert m.kv_bytes_per_token == (1152 + 132) * v32.num_hidden_layers
    assert m.page_bytes == m.kv_bytes_per_token * 64
    plain = MemoryModel(v32, world=8, weight_dtype="bf16", kv_dtype="bf16", index_dtype="bf16")
    assert plain.index_bytes_per_token_per_layer == 256
    glm = preset_config("glm-5", scale="full")
    glm["index_topk_pattern"] = "FFS" * 26
    shared = ModelConfig.from_hf(glm)
    g = MemoryModel(shared, world=8, kv_dtype="fp8", index_dtype="fp8")
    assert g.kv_bytes_per_token == (580 * 78 + 132 * 52)
