"""make_model: tiny checkpoints per preset, size refusal, reproducible seeds."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from splash.errors import ConfigError
from splash.model.config import ModelConfig
from splash.model.presets import PRESETS, make_model


@pytest.mark.parametrize("preset", PRESETS)
def test_tiny_checkpoint_written(preset, tmp_path):
    out = make_model(tmp_path / "m", preset, layers=2, seed=1)
    cfg = ModelConfig.from_hf(out)
    assert cfg.num_hidden_layers == 2 and cfg.hidden_size == 64 and cfg.kv_lora_rank == 32
    assert cfg.is_moe_layer(1) and not cfg.is_moe_layer(0)
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"


def test_seed_reproducible(tmp_path):
    a = load_file(str(make_model(tmp_path / "a", "glm-5", seed=4) / "model.safetensors"))
    b = load_file(str(make_model(tmp_path / "b", "glm-5", seed=4) / "model.safetensors"))
    c = load_file(str(make_model(tmp_path / "c", "glm-5", seed=5) / "model.safetensors"))
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    assert (a[name] == b[name]).all() and not (a[name] == c[name]).all()


def test_full_scale_weights_refused(tmp_path):
    with pytest.raises(ConfigError, match="at most"):
        make_model(tmp_path / "big", "deepseek-v3", layers=1, scale="full")
    assert not (tmp_path / "big").exists()


@pytest.mark.parametrize("kwargs, match", [({"preset": "llama"}, "unknown preset"),
                                           ({"scale": "huge"}, "unknown scale"),
                                           ({"layers": 0}, "layers")])
def test_bad_arguments(tmp_path, kwargs, match):
    args = {"preset": "deepseek-v3", **kwargs}
    with pytest.raises(ConfigError, match=match):
        make_model(tmp_path / "x", **args)


def test_make_model_cli(tmp_path, capsys):
    from splash.cli import main

    assert main(["make-model", str(tmp_path / "m"), "--preset", "kimi-k2", "--layers", "2"]) == 0
    assert ModelConfig.from_hf(tmp_path / "m").num_hidden_layers == 2
    assert "kimi-k2" in capsys.readouterr().out
    assert main(["make-model", str(tmp_path / "f"), "--preset", "glm-5", "--scale", "full"]) == 2
