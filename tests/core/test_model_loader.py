"""Checkpoint loading: sharded layouts, FP8 block dequantisation, skipped tensors, errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from splash.errors import ConfigError
from splash.model.loader import dequant_block_fp8, from_pretrained_dir, take
from splash.model.model import DenseReferenceAttention, MLAModel
from splash.model.presets import make_model

torch.set_num_threads(1)  # tiny tensors: extra threads only contend under xdist


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("v32"), "deepseek-v3.2", seed=9)


def _logits(cfg, weights, ids):
    model, ref = MLAModel(cfg, weights), DenseReferenceAttention()
    pos = torch.arange(len(ids))
    ref.set_step([0] * len(ids), pos)
    with torch.no_grad():
        return model.compute_logits(model(ids, pos, ref))


def _rewrite(src, dst, tensors, config_update=None, shards=1, index=True):
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(config_update or {})
    (dst / "config.json").write_text(json.dumps(cfg))
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors" if shards > 1 else "model.safetensors"
        part = {n: tensors[n].contiguous() for n in names[s::shards]}
        save_file(part, str(dst / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    if index and shards > 1:
        (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return dst


@pytest.mark.parametrize("index", [True, False])
def test_sharded_equals_single_file(tiny_dir, tmp_path, index):
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    sharded = _rewrite(tiny_dir, tmp_path / "sharded", tensors, shards=3, index=index)
    ids = torch.tensor([5, 9, 2, 200, 17])
    torch.testing.assert_close(_logits(*from_pretrained_dir(sharded), ids),
                               _logits(*from_pretrained_dir(tiny_dir), ids), atol=0, rtol=0)


def test_mtp_weights_are_skipped_indexer_weights_kept(tiny_dir, tmp_path):
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    cfg, _ = from_pretrained_dir(tiny_dir)
    n = cfg.num_hidden_layers
    extra = {f"model.layers.{n}.eh_proj.weight": torch.zeros(4, 4),
             f"model.layers.{n}.self_attn.kv_b_proj.weight": torch.zeros(4, 4)}
    path = _rewrite(tiny_dir, tmp_path / "mtp", {**tensors, **extra},
                    {"num_nextn_predict_layers": 1})
    cfg, weights = from_pretrained_dir(path)
    assert not any(k.startswith(f"model.layers.{n}.") for k in weights)
    indexer = {k for k in tensors if ".indexer." in k}
    assert indexer and indexer <= set(weights) and cfg.is_dsa  # a DSA model needs them
    assert all(weights[k].dtype == torch.float32 for k in indexer if "weights_proj" in k)
    MLAModel(cfg, weights)


def test_fp8_block_dequantisation(tiny_dir, tmp_path):
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    block, quantised, expected = (16, 16), dict(tensors), {}
    for name, w in tensors.items():
        if w.dim() != 2 or not name.endswith("proj.weight"):
            continue
        rows, cols = -(-w.shape[0] // 16), -(-w.shape[1] // 16)
        scale = torch.rand(rows, cols) * 0.01 + 0.001
        full = scale.repeat_interleave(16, 0).repeat_interleave(16, 1)[:w.shape[0], :w.shape[1]]
        q = (w / full).to(torch.float8_e4m3fn)
        quantised[name], quantised[name + "_scale_inv"] = q, scale
        expected[name] = q.float() * full
    path = _rewrite(tiny_dir, tmp_path / "fp8", quantised, {"quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block)}})
    cfg, weights = from_pretrained_dir(path, dtype="float32")
    assert cfg.fp8_block_size == block and not any(k.endswith("_scale_inv") for k in weights)
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    torch.testing.assert_close(weights[name], expected[name], atol=0, rtol=0)
    # Slices at unaligned offsets read only their blocks and equal the full dequantisation.
    torch.testing.assert_close(take(weights, name, 0, 5, 37), expected[name][5:37])
    torch.testing.assert_close(take(weights, name, 1, 3, 21), expected[name][:, 3:21])
    assert weights.dtype == torch.float32
    ref = {**{k: v for k, v in tensors.items()}, **expected}
    torch.testing.assert_close(_logits(cfg, weights, torch.tensor([3, 4, 5])),
                               _logits(cfg, ref, torch.tensor([3, 4, 5])), atol=1e-5, rtol=0)
    assert from_pretrained_dir(path)[1][name].dtype == torch.bfloat16  # default for fp8


def test_dequant_edge_blocks():
    w = torch.randn(5, 7).to(torch.float8_e4m3fn)
    s = torch.tensor([[2.0, 3.0], [5.0, 7.0]])
    want = w.float() * torch.tensor([[2.0] * 4 + [3.0] * 3] * 4 + [[5.0] * 4 + [7.0] * 3])
    torch.testing.assert_close(dequant_block_fp8(w, s, (4, 4)), want)
    torch.testing.assert_close(dequant_block_fp8(w[3:5, 2:6], s, (4, 4), 3, 2), want[3:5, 2:6])


def test_bf16_load_keeps_router_fp32(tiny_dir):
    _, weights = from_pretrained_dir(tiny_dir, dtype="bfloat16")
    assert weights["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert weights["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert weights["model.layers.1.self_attn.o_proj.weight"].dtype == torch.bfloat16


def test_errors_are_config_errors(tiny_dir, tmp_path):
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    del tensors["model.layers.2.self_attn.kv_b_proj.weight"]
    cfg, weights = from_pretrained_dir(_rewrite(tiny_dir, tmp_path / "missing", tensors))
    with pytest.raises(ConfigError, match="model.layers.2.self_attn.kv_b_proj.weight"):
        MLAModel(cfg, weights)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text((tiny_dir / "config.json").read_text())
    with pytest.raises(ConfigError, match="no \\*.safetensors"):
        from_pretrained_dir(tmp_path / "empty")
    with pytest.raises(ConfigError, match="no HF config.json"):
        from_pretrained_dir(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="unsupported weight dtype"):
        from_pretrained_dir(tiny_dir, dtype="int8")
