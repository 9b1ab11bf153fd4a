"""SPLASH's MLA model against HF transformers (the oracle) on tiny random fp32 checkpoints.

Checkpoints are built by transformers' own classes (save_pretrained) and by `make_model`;
SPLASH loads them through its loader, runs with the dense reference attention at world=1,
and must give the same logits (max abs diff <= 1e-4) and the same greedy tokens.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiny_models import randomise  # noqa: E402

from splash.model.loader import from_pretrained_dir  # noqa: E402
from splash.model.model import DenseReferenceAttention, MLAModel  # noqa: E402
from splash.model.presets import PRESETS, make_model  # noqa: E402
from splash.model.rope import inv_frequencies  # noqa: E402

torch.set_num_threads(1)  # tiny tensors: extra threads only contend under xdist

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
            qk_rope_head_dim=16, qk_nope_head_dim=16, n_routed_experts=8, first_k_dense_replace=1,
            max_position_embeddings=512, bos_token_id=0, eos_token_id=1)


def _yarn(mscale: float, mscale_all_dim: float) -> dict:
    return {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32,
            "beta_slow": 1, "mscale": mscale, "mscale_all_dim": mscale_all_dim,
            "original_max_position_embeddings": 128}


def _hf_config(arch: str):
    if arch == "v2":  # q_proj (no q LoRA), softmax router, group-limited greedy, YaRN
        return transformers.DeepseekV2Config(
            **TINY, q_lora_rank=None, v_head_dim=16, n_shared_experts=2, num_experts_per_tok=3,
            topk_method="group_limited_greedy", n_group=4, topk_group=2,
            routed_scaling_factor=1.5, rope_parameters=_yarn(0.707, 0.707))
    if arch in ("v3", "v3-halfsplit"):  # sigmoid + bias, groups, mscale != mscale_all_dim
        return transformers.DeepseekV3Config(
            **TINY, q_lora_rank=48, v_head_dim=24, n_shared_experts=1, num_experts_per_tok=2,
            n_group=4, topk_group=2, rope_parameters=_yarn(1.0, 0.8),
            rope_interleave=arch == "v3")
    if arch == "v32":  # DSA, half-split indexer RoPE; index_topk below the prompt lengths
        return transformers.DeepseekV32Config(
            **TINY, q_lora_rank=48, v_head_dim=24, n_shared_experts=1, num_experts_per_tok=2,
            n_group=4, topk_group=2, index_topk=5, index_head_dim=32, index_n_heads=8,
            rope_parameters=_yarn(1.0, 0.8))
    return transformers.GlmMoeDsaConfig(  # glm: DSA, interleaved indexer RoPE, a shared layer
        **TINY, q_lora_rank=48, v_head_dim=32, n_shared_experts=1, num_experts_per_tok=2,
        rms_norm_eps=1e-5, index_topk=6, index_head_dim=32, index_n_heads=8,
        indexer_types=["full", "shared", "full"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


@pytest.fixture(scope="module", params=["v2", "v3", "v3-halfsplit", "glm", "v32"])
def checkpoint(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(_hf_config(request.param))
    randomise(hf, seed=1)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return path, hf.eval()


def _prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(2, 256, (n,), generator=g) for n in (7, 11, 3)]


def _batched_logits(model: MLAModel, prompts: list[torch.Tensor]) -> list[torch.Tensor]:
    ref = DenseReferenceAttention()
    ids = torch.cat(prompts)
    pos = torch.cat([torch.arange(len(p)) for p in prompts])
    ref.set_step([i for i, p in enumerate(prompts) for _ in p], pos)
    logits = model.compute_logits(model(ids, pos, ref))
    return list(logits.split([len(p) for p in prompts]))


@torch.no_grad()
def test_logits_match_hf(checkpoint):
    path, hf = checkpoint
    model = MLAModel.from_pretrained(path)
    prompts = _prompts()
    for p, ours in zip(prompts, _batched_logits(model, prompts)):
        theirs = hf(p[None]).logits[0].float()
        assert theirs.abs().max() > 1.0  # the comparison is not between near-zero logits
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


@torch.no_grad()
def test_logits_match_hf_with_the_small_op_kernels(checkpoint, monkeypatch):
    """The GPU path of every RMSNorm (the Triton kernel, residual adds fused in), of every
    rotary embedding (MLA's and the DSA indexer's) and of the MoE router, run here under the
    interpreter."""
    import splash.model.mlp as mlp
    import splash.model.norm as norm
    import splash.model.rope as rope

    path, hf = checkpoint
    for module in (norm, rope, mlp):
        monkeypatch.setattr(module, "_kernel", lambda x: True)
    model = MLAModel.from_pretrained(path)
    prompts = _prompts()[:2]
    for p, ours in zip(prompts, _batched_logits(model, prompts)):
        torch.testing.assert_close(ours, hf(p[None]).logits[0].float(), atol=1e-4, rtol=0)


@torch.no_grad()
def test_greedy_tokens_match_hf_generate(checkpoint):
    path, hf = checkpoint
    model, new = MLAModel.from_pretrained(path), 8
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    prompts = _prompts()
    want = [hf.generate(p[None], do_sample=False, max_new_tokens=new)[0, len(p):].tolist()
            for p in prompts]
    # Ours: one batched prefill, then batched decode steps over the growing histories.
    ref = DenseReferenceAttention()
    ids = torch.cat(prompts)
    pos = torch.cat([torch.arange(len(p)) for p in prompts])
    seqs = [i for i, p in enumerate(prompts) for _ in p]
    ref.set_step(seqs, pos)
    hidden = model(ids, pos, ref)
    last = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    tokens = model.compute_logits(hidden[last]).argmax(-1)
    got = [[t] for t in tokens.tolist()]
    for step in range(1, new):
        pos = torch.tensor([len(p) + step - 1 for p in prompts])
        ref.set_step(list(range(len(prompts))), pos)
        tokens = model.compute_logits(model(tokens, pos, ref)).argmax(-1)
        for g, t in zip(got, tokens.tolist()):
            g.append(t)
    assert got == want


@pytest.mark.parametrize("preset", PRESETS)
@torch.no_grad()
def test_preset_checkpoint_loads_in_hf_and_matches(preset, tmp_path):
    path = make_model(tmp_path / preset, preset, seed=3)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    cfg, weights = from_pretrained_dir(path)
    model = MLAModel(cfg, weights)
    prompts = _prompts()[:2]
    for p, ours in zip(prompts, _batched_logits(model, prompts)):
        torch.testing.assert_close(ours, hf.eval()(p[None]).logits[0].float(), atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["v2", "v3", "glm"])
def test_rope_frequencies_match_hf(arch):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from splash.model.config import ModelConfig

    hf_cfg = _hf_config(arch)
    cfg = ModelConfig.from_hf(hf_cfg.to_dict())
    ours, scale = inv_frequencies(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
    rope_type = hf_cfg.rope_parameters["rope_type"]
    if rope_type == "default":
        theirs, their_scale = ours.new_tensor([]), 1.0
        dim = cfg.qk_rope_head_dim
        theirs = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    else:
        theirs, their_scale = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg)
    torch.testing.assert_close(ours, theirs, atol=0, rtol=0)
    assert scale == pytest.approx(their_scale)
    attn_cls = {"v2": transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2Attention,
                "v3": transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention,
                "glm": transformers.models.glm_moe_dsa.modeling_glm_moe_dsa.GlmMoeDsaAttention}
    assert cfg.sm_scale == pytest.approx(attn_cls[arch](hf_cfg, 0).scaling, rel=1e-12)
