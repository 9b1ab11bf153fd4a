"""ModelConfig.from_hf: families, rope formats, MoE layer choice, derived values, errors."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from splash.errors import ConfigError
from splash.model.config import ModelConfig
from splash.model.presets import PRESETS, checkpoint_shapes, preset_config


def _v3(**over):
    d = preset_config("deepseek-v3", "tiny")
    d.update(over)
    return d


def test_old_rope_scaling_equals_rope_parameters():
    new = _v3()
    old = dict(new)
    rp = old.pop("rope_parameters")
    old["rope_theta"] = rp.pop("rope_theta")
    rp["type"] = rp.pop("rope_type")
    old["rope_scaling"] = rp
    assert ModelConfig.from_hf(old) == ModelConfig.from_hf(new)


def test_yarn_sm_scale_and_cos_sin_scale():
    cfg = ModelConfig.from_hf(_v3(rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0, "mscale": 1.0,
        "mscale_all_dim": 0.8, "original_max_position_embeddings": 128}))
    m = 0.1 * 0.8 * math.log(40) + 1
    assert cfg.sm_scale == pytest.approx(cfg.qk_head_dim ** -0.5 * m * m)
    assert cfg.rope_scaling.cos_sin_scale == pytest.approx((0.1 * math.log(40) + 1) / m)
    plain = ModelConfig.from_hf(_v3(rope_parameters={"rope_type": "default", "rope_theta": 1e4}))
    assert plain.rope_scaling is None and plain.sm_scale == plain.qk_head_dim ** -0.5


def test_derived_fields():
    cfg = ModelConfig.from_hf(preset_config("deepseek-v3"))
    assert (cfg.kv_dim, cfg.qk_head_dim, cfg.q_in_dim) == (576, 192, 1536)
    assert [cfg.is_moe_layer(i) for i in range(5)] == [False] * 3 + [True] * 2
    assert cfg.eos_token_ids == [1] and not cfg.is_dsa and cfg.num_indexer_layers == 0
    lite = ModelConfig.from_hf(preset_config("deepseek-v2-lite"))
    assert lite.q_lora_rank is None and lite.q_in_dim == 2048
    assert (lite.scoring_func, lite.topk_method, lite.norm_topk_prob) == ("softmax", "greedy", False)
    glm = ModelConfig.from_hf(preset_config("glm-5"))
    assert glm.eos_token_ids == [154820, 154827, 154829] and glm.rms_norm_eps == 1e-5
    assert glm.is_dsa and glm.index_topk == 2048 and glm.index_rope_interleave
    assert glm.num_indexer_layers == glm.num_hidden_layers and glm.has_indexer(5)


def test_family_rules_follow_hf():
    # v3 family: HF always uses sigmoid + noaux_tc, whatever the json says
    cfg = ModelConfig.from_hf(_v3(scoring_func="softmax", topk_method="greedy"))
    assert (cfg.scoring_func, cfg.topk_method) == ("sigmoid", "noaux_tc")
    # Kimi-K2's own config names model_type kimi_k2
    assert ModelConfig.from_hf(_v3(model_type="kimi_k2")).topk_method == "noaux_tc"
    # v2 ignores rope_interleave (always interleaved); v3 honours it
    v2 = preset_config("deepseek-v2-lite", "tiny")
    assert ModelConfig.from_hf({**v2, "rope_interleave": False}).rope_interleave
    assert not ModelConfig.from_hf(_v3(rope_interleave=False)).rope_interleave


def test_mlp_layer_types():
    d = preset_config("deepseek-v3.2", "tiny")
    d["num_hidden_layers"] = 4
    d["mlp_layer_types"] = ["dense", "sparse", "dense", "sparse"]
    cfg = ModelConfig.from_hf(d)
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    freq = ModelConfig.from_hf(_v3(num_hidden_layers=5, first_k_dense_replace=1, moe_layer_freq=2))
    assert [freq.is_moe_layer(i) for i in range(5)] == [False, False, True, False, True]
    dense = ModelConfig.from_hf(_v3(n_routed_experts=None))
    assert not any(dense.is_moe_layer(i) for i in range(dense.num_hidden_layers))


def test_dsa_indexer_layers_follow_hf():
    """glm_moe_dsa: explicit indexer_types, an "FS" pattern, or freq/offset (as transformers'
    GlmMoeDsaConfig derives them); deepseek_v32: an indexer in every layer, half-split RoPE."""
    v32 = ModelConfig.from_hf(preset_config("deepseek-v3.2", "tiny"))
    assert v32.indexer_types == ("full",) * v32.num_hidden_layers and not v32.index_rope_interleave
    glm = preset_config("glm-5", "tiny")
    glm["num_hidden_layers"] = 6
    glm.pop("mlp_layer_types", None)
    types = {
        "indexer_types": (["full", "shared", "full", "shared", "shared", "full"], "FSFSSF"),
        "index_topk_pattern": ("FFSFSS", "FFSFSS"),
        "index_topk_freq": (3, "FFSSFS"),  # offset 2: layers 0, 1 full, then every third
    }
    for key, (value, want) in types.items():
        cfg = ModelConfig.from_hf({**glm, key: value})
        assert "".join(t[0].upper() for t in cfg.indexer_types) == want, key
        assert cfg.num_indexer_layers == want.count("F")
        assert [cfg.has_indexer(i) for i in range(6)] == [c == "F" for c in want]
    with pytest.raises(ConfigError, match="starting with 'full'"):
        ModelConfig.from_hf({**glm, "index_topk_pattern": "SFFFFF"})
    with pytest.raises(ConfigError, match="q_lora_rank"):
        ModelConfig.from_hf({**glm, "q_lora_rank": None})


@pytest.mark.parametrize("bad, match", [
    ({"model_type": "llama"}, "unsupported model_type"),
    ({"kv_lora_rank": None}, "lacks kv_lora_rank"),
    ({"n_group": 3}, "n_group"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope type"),
    ({"quantization_config": {"quant_method": "awq"}}, "quantization"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_invalid_configs_raise_config_error(bad, match):
    d = _v3(**bad)
    if bad.get("kv_lora_rank", 1) is None:
        del d["kv_lora_rank"]
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf(d)


def test_fp8_block_and_mtp_read():
    cfg = ModelConfig.from_hf(_v3(num_nextn_predict_layers=1, quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}))
    assert cfg.fp8_block_size == (128, 128) and cfg.num_nextn_predict_layers == 1


@pytest.mark.parametrize("preset, billions", [
    ("deepseek-v3", 671.0), ("deepseek-v2-lite", 15.7), ("kimi-k2", 1026.4), ("glm-5", 743.9),
    ("deepseek-v3.2", 671.9)])
def test_full_presets_have_published_sizes(preset, billions):
    cfg = ModelConfig.from_hf(preset_config(preset, "full"))
    total = sum(math.prod(s) for s in checkpoint_shapes(cfg).values())
    assert total / 1e9 == pytest.approx(billions, rel=2e-3)


def test_all_presets_parse_at_both_scales():
    for p in PRESETS:
        for scale in ("full", "tiny"):
            assert ModelConfig.from_hf(preset_config(p, scale)).kv_dim > 0


def test_config_and_presets_import_without_torch():
    code = ("import sys; import splash.model.config, splash.model.presets; "
            "from splash.model.presets import preset_config; preset_config('glm-5'); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
