"""Prefix caching and n samples at T=1 against transformers (fp32 CPU): multi-turn histories
reuse their cached pages and still give transformers' greedy tokens (also under preemption);
n samples are drawn from one prefill, each from its own seed stream (sample i draws what a
single request seeded ``sample_seed(seed, i)`` draws)."""

from __future__ import annotations

import pytest
from tiny_models import checkpoint, hf_greedy, mixed_prompts

from splash import LLM, SamplingParams
from splash.sampling_params import sample_seed

KW = dict(tp_size=1, backend="cpu", layout="tp", page_size=4, max_num_batched_tokens=16)


def _greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("pages", [None, 9])  # 9 pages: requests are preempted
def test_multi_turn_reuses_cached_pages(pages):
    path = checkpoint("v3")
    first = mixed_prompts(seed=8, lengths=(13, 6, 22))
    with LLM(path, kv_pages_per_rank=pages, **KW) as llm:
        turn1 = llm.generate(first, _greedy(5))
        second = [p + o.token_ids + [40 + i, 41] for i, (p, o) in enumerate(zip(first, turn1))]
        turn2 = llm.generate(second, _greedy(5))
        stats = llm.stats()
    assert [o.token_ids for o in turn1] == hf_greedy(path, first, 5)
    assert [o.token_ids for o in turn2] == hf_greedy(path, second, 5)
    # every full page of turn 1's computed history (prompt + 4 of its 5 outputs) is a hit
    cached = sum((len(p) + 4) // 4 * 4 for p in first)
    assert stats["prefix_cache_hit_tokens"] >= (cached if pages is None else 4)
    assert stats["prefix_cache_queried_tokens"] >= sum(map(len, first + second))
    if pages is not None:
        assert stats["num_preemptions"] > 0
    assert stats["kv_pages_used"] == [0]


def test_n_samples_from_one_prefill_each_with_its_own_seed():
    path = checkpoint("v3")
    prompt = mixed_prompts(seed=2, lengths=(10,))[0]  # 2.5 pages: the samples copy page 3
    n = 4  # samples (four distinct draws show what eight did, in half the rows a step)
    sampled = SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=n, logprobs=1)
    with LLM(path, enable_prefix_caching=False, **KW) as llm:
        out = llm.generate([prompt], sampled)[0]
        stats = llm.stats()
        singles = llm.generate([prompt] * n, [
            SamplingParams(max_tokens=6, temperature=1.0, seed=sample_seed(3, i))
            for i in range(n)])
        # min_tokens = max_tokens holds EOS back as transformers' min_new_tokens does
        greedy = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, n=4,
                                                       min_tokens=6))[0]
    assert stats["prompt_tokens_computed"] == len(prompt)  # one prefill for all n
    assert [c.index for c in out.outputs] == list(range(n))
    assert len({tuple(c.token_ids) for c in out.outputs}) == n
    assert [c.token_ids for c in out.outputs] == [s.token_ids for s in singles]
    assert out.token_ids == out.outputs[0].token_ids and out.finished
    assert all(len(c.logprobs) == 6 for c in out.outputs)
    want = hf_greedy(path, [prompt], 6)[0]
    assert [c.token_ids for c in greedy.outputs] == [want] * 4
    assert stats["kv_pages_used"] == [0]
