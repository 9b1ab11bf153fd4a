"""Prefill chunks in the non-absorbed form (``SPLASH_MHA_PREFILL``: keys and values expanded from
the latent rows) give transformers' greedy tokens, fp32 on CPU: every architecture (q LoRA and
q_proj, YaRN, interleaved rope, GLM-5's dense steps within index_topk), chunked prompts whose
later chunks attend their earlier chunks, and every layout that uses it (TP, DP and CP at
T=2; CP's query rows are split over the ranks, each over the gathered histories)."""

from __future__ import annotations

import pytest
from tiny_models import DEV, checkpoint, hf_greedy, mixed_prompts

from splash import LLM, SamplingParams
from splash.errors import ConfigError

MAX_NEW = 5


# ("v3" | "glm", 1, "tp", "auto"): the engine's default (SPLASH_MHA_PREFILL=auto), which
# test_engine_vs_hf's chunked cases run with exactly these engine settings, prompt lengths
# and prefill steps (there against transformers' tokens and logprobs)
@pytest.mark.parametrize("arch,tp,layout,setting", [
    ("v2", 1, "tp", "2"), ("v3", 1, "tp", "2"), ("glm", 1, "tp", "2"), ("v3", 2, "dp", "2"),
    ("v3", 2, "tp", "2"), ("v3", 2, "cp", "2"), ("v3", 2, "dp", "auto")])
def test_expanded_prefill_same_tokens_as_transformers(monkeypatch, arch, tp, layout, setting):
    """"2": every step of two rows or more expanded, decode rows of mixed steps included;
    "auto": in mixed steps the prefill chunks expanded and the decode rows absorbed beside them
    (the chunks of these prompts gain at the tiny checkpoints' dims, their decode rows do not)."""
    monkeypatch.setenv("SPLASH_MHA_PREFILL", setting)
    path = checkpoint(arch)
    prompts = mixed_prompts()
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    with LLM(path, tp_size=tp, layout=layout, page_size=4, max_num_batched_tokens=16,
             **DEV) as llm:
        ours = [o.token_ids for o in llm.generate(prompts, params)]
    assert ours == hf_greedy(path, prompts, MAX_NEW)


def test_a_bad_setting_is_refused_at_start(monkeypatch):
    monkeypatch.setenv("SPLASH_MHA_PREFILL", "long")
    with pytest.raises(ConfigError, match="SPLASH_MHA_PREFILL"):
        LLM(checkpoint("v3"), backend="cpu")
