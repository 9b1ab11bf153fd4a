"""The single-rank engine (paged KV, Triton kernels, continuous batching) gives transformers'
greedy tokens, fp32 on CPU, for mixed batches — with chunked prefill on and off and under
preemption, and for DSA models whose index_topk is below the contexts (GLM-5 and DeepSeek-V3.2
architectures: top-k sparse attention, not a dense fallback)."""

from __future__ import annotations

import json

import pytest
from test_logprobs import K, check_logprobs
from tiny_models import checkpoint, hf_greedy, hf_greedy_full, mixed_prompts

from splash import LLM, SamplingParams
from splash.errors import InvalidRequestError

MAX_NEW = 6


@pytest.fixture(scope="module", params=["v2", "v3", "glm"])
def arch(request):
    return request.param


def _run(path, prompts, too_long=None, logprobs=None, **kw):
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True,
                            **(logprobs or {}))
    with LLM(path, tp_size=1, backend="cpu", layout="tp", page_size=4, **kw) as llm:
        if too_long is not None:  # a prompt no step may compute whole: refused, nothing lost
            with pytest.raises(InvalidRequestError, match="max_num_batched_tokens"):
                llm.generate([too_long], params)
        outs = llm.generate(prompts, params)
        return outs, llm.stats()


def _tokens(outs):
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("chunked", [True, False])
def test_same_tokens_as_transformers(arch, chunked, monkeypatch):
    """Unchunked, a step holds whole prompts (up to 37 tokens here) and never more rows than
    max_num_batched_tokens, the size the workers profiled. Chunked, the same run also gives
    logprobs of every generated and prompt position, checked against transformers'
    log-softmax (test_logprobs' check; one engine for both)."""
    # the default, spelled out: test_expanded_prefill counts on these runs for its "auto" at T=1
    monkeypatch.setenv("SPLASH_MHA_PREFILL", "auto")
    path = checkpoint(arch)
    prompts = mixed_prompts(seed=4 if chunked else 0)  # (test_logprobs' prompts when chunked)
    budget = 16 if chunked else 40
    outs, _ = _run(path, prompts, None if chunked else list(range(2, 43)),
                   dict(logprobs=K, prompt_logprobs=2) if chunked else None,
                   max_num_batched_tokens=budget, enable_chunked_prefill=chunked)
    assert _tokens(outs) == hf_greedy(path, prompts, MAX_NEW)
    if chunked:
        check_logprobs(path, prompts, outs, prompt_k=2)


@pytest.mark.parametrize("dsa_arch", ["glm-dsa", "v32"])
def test_dsa_beyond_index_topk_same_tokens_as_transformers(dsa_arch):
    path = checkpoint(dsa_arch, index_topk=8)  # prompts up to 37 tokens, then 6 more each
    prompts = mixed_prompts()
    outs, stats = _run(path, prompts, max_num_batched_tokens=16)
    assert _tokens(outs) == hf_greedy(path, prompts, MAX_NEW)
    assert stats["kv_pages_used"] == [0]


def test_dsa_split_top_k_with_the_indexer_floor(monkeypatch):
    """The GPU's selection on the CPU: split passes that compact their winners, the first
    dropping entries under the floor that the indexer's 8-token group maxima give (index_topk
    4, chunks of 16: histories past 32 tokens take it, in prefill chunks and decode)."""
    monkeypatch.setenv("SPLASH_KERNEL_CONFIG", json.dumps(
        {"topk": {"CHUNK": 16, "ROWS": 1, "FLOOR_N": 16}}))
    # one layer: its indexer's launches are the selection under test; a second layer only
    # repeated them (the interpreter's time here: ~45 s with two layers, ~25 s with one)
    path = checkpoint("v32", index_topk=4, num_hidden_layers=1)
    prompts = mixed_prompts(seed=5, lengths=(1, 9, 40))
    outs, _ = _run(path, prompts, max_num_batched_tokens=16)
    # (full forwards: with two layers transformers' cached generate parted from them here)
    assert _tokens(outs) == hf_greedy_full(path, prompts, MAX_NEW)


def test_preemption_keeps_tokens():
    path = checkpoint("v3")
    prompts = mixed_prompts(seed=3, lengths=(9, 10, 11, 12))
    # 12 pages of 4 tokens cannot hold four 15-17 token histories at once: someone is
    # preempted and recomputed, and every request still gets transformers' tokens
    outs, stats = _run(path, prompts, kv_pages_per_rank=12, max_num_batched_tokens=64)
    assert _tokens(outs) == hf_greedy(path, prompts, MAX_NEW)
    assert stats["num_preemptions"] > 0
    assert stats["kv_pages_used"] == [0]
