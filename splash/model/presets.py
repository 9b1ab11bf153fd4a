"""Architecture presets and `splash make-model`: random HF-format checkpoints.

`preset_config(preset, scale)` returns an HF config.json dict: "full" keeps the published
dimensions (for `splash plan`), "tiny" shrinks them (hidden 64, 4-8 heads, L=32, R=16, vocab
256, 8-12 experts top-2, 3 layers) for CPU tests and the demo. `make_model` writes config.json
+ model.safetensors that `transformers.AutoModelForCausalLM.from_pretrained` loads too.
Kimi-K2 is written as model_type deepseek_v3 (its own config.json says "kimi_k2" and needs
remote code; `ModelConfig.from_hf` accepts both). The full presets state bf16 weights, which is
what SPLASH serves after dequantising DeepSeek's FP8 checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from splash.errors import ConfigError
from splash.model.config import ModelConfig

PRESETS = ("deepseek-v3", "deepseek-v2-lite", "deepseek-v3.2", "kimi-k2", "glm-5")
MAX_WRITE_BYTES = 2 * 1024 ** 3

_YARN_V3 = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096}
_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc",
    "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu",
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_parameters": _YARN_V3,
    "rope_interleave": True, "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
    "attention_bias": False, "num_nextn_predict_layers": 1, "dtype": "bfloat16"}
_FULL: dict[str, dict[str, Any]] = {
    "deepseek-v3": _V3,
    "deepseek-v2-lite": {
        **_V3, "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
        "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
        "routed_scaling_factor": 1.0, "q_lora_rank": None, "topk_method": "greedy", "n_group": 1,
        "topk_group": 1, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
        "norm_topk_prob": False, "scoring_func": "softmax", "bos_token_id": 100000,
        "eos_token_id": 100001, "num_nextn_predict_layers": 0,
        "rope_parameters": {**_YARN_V3, "mscale": 0.707, "mscale_all_dim": 0.707}},
    "deepseek-v3.2": {**_V3, "architectures": ["DeepseekV32ForCausalLM"],
                      "model_type": "deepseek_v32", "index_topk": 2048, "index_head_dim": 128,
                      "index_n_heads": 64},
    "kimi-k2": {
        **_V3, "vocab_size": 163840, "num_attention_heads": 64, "num_key_value_heads": 64,
        "n_routed_experts": 384, "routed_scaling_factor": 2.827, "n_group": 1, "topk_group": 1,
        "first_k_dense_replace": 1, "max_position_embeddings": 131072,
        "bos_token_id": 163584, "eos_token_id": 163585, "num_nextn_predict_layers": 0,
        "rope_parameters": {**_YARN_V3, "rope_theta": 50000.0, "factor": 32.0, "beta_fast": 1,
                            "beta_slow": 1}},
    "glm-5": {
        **_V3, "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
        "vocab_size": 154880, "hidden_size": 6144, "intermediate_size": 12288,
        "num_hidden_layers": 78, "num_attention_heads": 64, "num_key_value_heads": 64,
        "q_lora_rank": 2048, "v_head_dim": 256, "qk_nope_head_dim": 192, "n_group": 1,
        "topk_group": 1, "max_position_embeddings": 202752, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "eos_token_id": [154820, 154827, 154829], "index_topk": 2048, "index_head_dim": 128,
        "index_n_heads": 32},
}
_TINY_COMMON: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
    "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 24,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
    "max_position_embeddings": 512, "bos_token_id": 0, "eos_token_id": 1,
    "num_nextn_predict_layers": 0, "dtype": "float32"}
_TINY: dict[str, dict[str, Any]] = {
    "deepseek-v3": {"q_lora_rank": 48, "n_group": 4, "topk_group": 2},
    "deepseek-v2-lite": {"v_head_dim": 16},
    "deepseek-v3.2": {"q_lora_rank": 48, "n_group": 4, "topk_group": 2, "index_topk": 512,
                      "index_head_dim": 32, "index_n_heads": 4},
    "kimi-k2": {"q_lora_rank": 48, "num_attention_heads": 8, "num_key_value_heads": 8,
                "v_head_dim": 16, "n_routed_experts": 12},
    "glm-5": {"q_lora_rank": 48, "qk_nope_head_dim": 24, "v_head_dim": 32, "index_topk": 512,
              "index_head_dim": 32, "index_n_heads": 4},
}


def preset_config(preset: str, scale: str = "full") -> dict[str, Any]:
    """HF config.json dict of a preset at "full" (published) or "tiny" (test) scale."""
    if preset not in _FULL:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if scale not in ("full", "tiny"):
        raise ConfigError(f"unknown scale {scale!r}; use 'full' or 'tiny'")
    d = json.loads(json.dumps(_FULL[preset]))  # deep copy
    if scale == "tiny":
        d.update(_TINY_COMMON)
        d.update(_TINY[preset])
        rp = d["rope_parameters"]
        if rp["rope_type"] == "yarn":
            rp.update(factor=4.0, original_max_position_embeddings=128)
    return d


def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF checkpoint (MTP layers excluded, DSA indexer included)."""
    H, nh, L, R = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, H),
                                          "model.norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, H)

    def mlp(p: str, size: int) -> None:
        shapes.update({p + "gate_proj.weight": (size, H), p + "up_proj.weight": (size, H),
                       p + "down_proj.weight": (H, size)})

    for i in range(cfg.num_hidden_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        shapes[p + "input_layernorm.weight"] = shapes[p + "post_attention_layernorm.weight"] = (H,)
        if cfg.q_lora_rank is None:
            shapes[a + "q_proj.weight"] = (nh * cfg.qk_head_dim, H)
        else:
            shapes.update({a + "q_a_proj.weight": (cfg.q_lora_rank, H),
                           a + "q_a_layernorm.weight": (cfg.q_lora_rank,),
                           a + "q_b_proj.weight": (nh * cfg.qk_head_dim, cfg.q_lora_rank)})
        shapes.update({a + "kv_a_proj_with_mqa.weight": (L + R, H),
                       a + "kv_a_layernorm.weight": (L,),
                       a + "kv_b_proj.weight": (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), L),
                       a + "o_proj.weight": (H, nh * cfg.v_head_dim)})
        if cfg.has_indexer(i):
            n, d = cfg.index_n_heads or 0, cfg.index_head_dim or 0
            shapes.update({a + "indexer.wq_b.weight": (n * d, cfg.q_in_dim),
                           a + "indexer.wk.weight": (d, H), a + "indexer.k_norm.weight": (d,),
                           a + "indexer.k_norm.bias": (d,), a + "indexer.weights_proj.weight": (n, H)})
        if not cfg.is_moe_layer(i):
            mlp(p + "mlp.", cfg.intermediate_size)
            continue
        E, m = cfg.n_routed_experts, cfg.moe_intermediate_size
        shapes[p + "mlp.gate.weight"] = (E, H)
        if cfg.topk_method == "noaux_tc":
            shapes[p + "mlp.gate.e_score_correction_bias"] = (E,)
        for e in range(E):
            mlp(f"{p}mlp.experts.{e}.", m)
        if cfg.n_shared_experts:
            mlp(p + "mlp.shared_experts.", m * cfg.n_shared_experts)
    return shapes


def make_model(out_dir: str | Path, preset: str, layers: int | None = None, seed: int = 0,
               scale: str = "tiny") -> Path:
    """Write a random checkpoint (config.json + model.safetensors) of a preset to out_dir.

    Refuses to write more than 2 GB of weights (full-scale dims are meant for `splash plan`,
    which needs only `preset_config`)."""
    import torch
    from safetensors.torch import save_file

    d = preset_config(preset, scale)
    if layers is not None:
        if layers <= 0:
            raise ConfigError(f"layers must be positive, got {layers}")
        d["num_hidden_layers"] = layers
    cfg = ModelConfig.from_hf(d)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[d["dtype"]]
    shapes = checkpoint_shapes(cfg)
    nbytes = sum(_numel(s) for s in shapes.values()) * dtype.itemsize
    if nbytes > MAX_WRITE_BYTES:
        raise ConfigError(
            f"{preset} at scale {scale!r} with {cfg.num_hidden_layers} layers would write "
            f"{nbytes / 1e9:.1f} GB of random weights; make-model writes at most "
            f"{MAX_WRITE_BYTES / 1e9:.1f} GB: use --scale tiny (full dims are for `splash plan`)")
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        tensors[name] = _random(name, shape, gen).to(dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(d, indent=2) + "\n")
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _random(name: str, shape: tuple[int, ...], gen: Any) -> Any:
    import torch

    return unit_scale(name, torch.randn(shape, generator=gen))


def unit_scale(name: str, x: Any) -> Any:
    """O(1)-activation init of parameter ``name`` from a standard normal ``x`` of its shape:
    norms ~1, biases small, matrices N(0, 1/fan_in), embeddings N(0, 1). HF's std-0.02 init
    gives near-uniform logits, where rounding differences flip near-tied greedy tokens."""
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * x
    if x.dim() == 1:
        return 0.05 * x
    if "embed_tokens" in name:
        return x
    return x * x.shape[-1] ** -0.5


def make_model_main(args: Any) -> int:
    """`splash make-model OUT_DIR --preset P [--layers N] [--seed S] [--scale tiny|full]`."""
    out = make_model(args.out_dir, args.preset, layers=args.layers, seed=args.seed,
                     scale=args.scale)
    cfg = ModelConfig.from_hf(out)
    print(f"wrote {args.preset} ({args.scale}, {cfg.num_hidden_layers} layers, "
          f"seed {args.seed}) to {out}")
    return 0
