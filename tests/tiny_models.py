"""Tiny random HF checkpoints for engine tests, built by transformers' own classes (the oracle).

Weights get O(1) activations (HF's 0.02-std init gives near-uniform logits, where greedy ties
would make token comparisons meaningless). Checkpoints are cached per test session.
"""

from __future__ import annotations

import os
import tempfile

import torch

from splash.model.presets import unit_scale

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
            qk_rope_head_dim=16, qk_nope_head_dim=16, n_routed_experts=8, first_k_dense_replace=1,
            max_position_embeddings=256, bos_token_id=0, eos_token_id=1)


def hf_config(arch: str, **over):
    import transformers

    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8,
            "original_max_position_embeddings": 64}
    base = {**TINY, **over}
    if arch == "v2":  # q_proj (no q LoRA), softmax router, YaRN
        return transformers.DeepseekV2Config(
            **base, q_lora_rank=None, v_head_dim=16, n_shared_experts=1, num_experts_per_tok=2,
            topk_method="greedy", rope_parameters=dict(yarn, mscale=0.707, mscale_all_dim=0.707))
    if arch == "v3":  # q LoRA, sigmoid + bias, group-limited top-k, v_head_dim != nope
        return transformers.DeepseekV3Config(
            **base, q_lora_rank=48, v_head_dim=24, n_shared_experts=1, num_experts_per_tok=2,
            n_group=4, topk_group=2, rope_parameters=yarn)
    if arch == "glm":  # GLM-5 architecture (DSA; dense while context <= index_topk)
        base.setdefault("index_topk", 256)
        return transformers.GlmMoeDsaConfig(
            **base, q_lora_rank=48, v_head_dim=32, n_shared_experts=1, num_experts_per_tok=2,
            index_head_dim=32, index_n_heads=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    # DSA with index_topk far below the contexts (prompts up to ~130 tokens): 8 index heads
    # keep exact score ties (all heads' relu at 0) rare, so top-k picks are well defined
    if arch == "glm-dsa":  # interleaved indexer RoPE; layer 1 reuses layer 0's picks
        base = {"index_topk": 16, "indexer_types": ["full", "shared"], **base}
        return transformers.GlmMoeDsaConfig(
            **base, q_lora_rank=48, v_head_dim=32, n_shared_experts=1, num_experts_per_tok=2,
            index_head_dim=32, index_n_heads=8,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if arch == "v32":  # DeepSeek-V3.2: half-split indexer RoPE, YaRN, an indexer per layer
        base = {"index_topk": 16, **base}
        return transformers.DeepseekV32Config(
            **base, q_lora_rank=48, v_head_dim=24, n_shared_experts=1, num_experts_per_tok=2,
            n_group=4, topk_group=2, index_head_dim=32, index_n_heads=8, rope_parameters=yarn)
    raise ValueError(arch)


def randomise(model, seed: int) -> None:
    """O(1) activations (HF's std-0.02 init gives near-uniform logits)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name or not t.is_floating_point():
                continue
            t.copy_(unit_scale(name, torch.randn(t.shape, generator=g)))


_CACHE: dict[tuple, str] = {}


def checkpoint(arch: str = "v3", **over) -> str:
    """Path of a tiny random checkpoint (built once per process and arguments)."""
    import transformers

    key = (arch, tuple(sorted(over.items())))
    if key not in _CACHE:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(hf_config(arch, **over))
        randomise(model, seed=1)
        path = tempfile.mkdtemp(prefix=f"splash-{arch}-")
        model.save_pretrained(path)
        _CACHE[key] = path
    return _CACHE[key]


def _hf_model(path: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own greedy generate, one prompt at a time (no padding effects)."""
    model, outs = _hf_model(path), []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 do_sample=False, attention_mask=torch.ones_like(ids))
        outs.append(gen[0, len(p):].tolist())
    return outs


def hf_greedy_full(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens from full forwards over the whole sequence at every step (no
    KV cache). For DSA checkpoints its cached generate can part from its own full forward (seen
    with DeepSeek-V3.2, index_topk 4 and a 9-token prompt: a different first token)."""
    model, outs = _hf_model(path), []
    for p in prompts:
        seq = torch.tensor([p])
        with torch.no_grad():
            for _ in range(max_new_tokens):
                nxt = model(seq, use_cache=False).logits[0, -1].argmax()
                seq = torch.cat([seq, nxt.view(1, 1)], 1)
        outs.append(seq[0, len(p):].tolist())
    return outs


def mixed_prompts(seed: int = 0, lengths=(1, 4, 7, 16, 37)) -> list[list[int]]:
    """Mixed lengths: 1 token, page-boundary lengths (page 4), longer than a 16-row chunk."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 256, (n,), generator=g).tolist() for n in lengths]


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# engine device for the multi-rank tests: CPU by default; on one GPU the same tests run with
# CUDA tensors over gloo (SPLASH_TEST_BACKEND=cuda SPLASH_DIST_BACKEND=gloo), fp32 so tokens
# stay comparable with transformers
DEV = {"backend": os.environ.get("SPLASH_TEST_BACKEND", "cpu"),
       "dtype": os.environ.get("SPLASH_TEST_DTYPE", "fp32")}
