"""Logprobs and prompt logprobs equal transformers' log-softmax (fp32 CPU, within 1e-4): the
chosen token and the top-k of every generated position, every prompt token's, at T=1 and
over two ranks, greedy and sampled (the logprobs are the raw model's, whatever the temperature),
and with chunked prefill and preemption (no position scored twice)."""

from __future__ import annotations

import torch
from tiny_models import DEV, checkpoint, mixed_prompts

from splash import LLM, SamplingParams

K = 3
TOL = 1e-4


def hf_logprobs(path: str, tokens: list[int]) -> torch.Tensor:
    """transformers' log-softmax over the vocabulary at every position of ``tokens``."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0]
    return logits.float().log_softmax(-1)  # (len, V)


def _check_position(got: dict[int, float], want_row: torch.Tensor, token: int, k: int) -> None:
    assert abs(got[token] - float(want_row[token])) < TOL
    top = want_row.topk(k)
    ranked = sorted(got.items(), key=lambda kv: -kv[1])
    assert len(got) in (k, k + 1) and token in got
    # the top-k ids (ties aside) and values
    assert [round(v, 3) for _, v in ranked[:k]] == [round(float(v), 3) for v in top.values]
    for tid, lp in got.items():
        assert abs(lp - float(want_row[tid])) < TOL


def check_logprobs(path, prompts, outs, k=K, prompt_k=None):
    for prompt, out in zip(prompts, outs):
        want = hf_logprobs(path, prompt + out.token_ids)
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
        for j, (tok, got) in enumerate(zip(out.token_ids, out.logprobs)):
            _check_position(got, want[len(prompt) + j - 1], tok, k)
        if prompt_k is not None:
            assert out.prompt_logprobs is not None
            assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
            for j in range(1, len(prompt)):
                _check_position(out.prompt_logprobs[j], want[j - 1], prompt[j], prompt_k)


# greedy logprobs and prompt logprobs at T=1 per architecture (the top-K of every generated
# position, the top-2 of every prompt position, chunked prefill): checked in
# test_engine_vs_hf's chunked runs, on the very engine that compares tokens with transformers


def test_sampled_logprobs_are_the_raw_models_over_two_ranks():
    path = checkpoint("v3")
    prompts = mixed_prompts(seed=5, lengths=(3, 9, 20))
    params = [SamplingParams(max_tokens=6, temperature=t, top_k=tk, seed=7 + i, ignore_eos=True,
                             logprobs=k)
              for i, (t, tk, k) in enumerate([(1.5, 0, 0), (0.7, 5, 4), (1.0, 0, 2)])]
    with LLM(path, tp_size=2, layout="dop", page_size=4, max_num_batched_tokens=8,
             **DEV) as llm:
        outs = llm.generate(prompts, params)
    for prompt, out, p in zip(prompts, outs, params):
        check_logprobs(path, [prompt], [out], k=p.logprobs)


def test_prompt_logprobs_once_under_preemption():
    path = checkpoint("v3")
    prompts = mixed_prompts(seed=3, lengths=(9, 10, 11, 12))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1,
                            prompt_logprobs=1)
    with LLM(path, tp_size=1, backend="cpu", layout="tp", page_size=4, kv_pages_per_rank=12,
             max_num_batched_tokens=8) as llm:
        outs = llm.generate(prompts, params)
        assert llm.stats()["num_preemptions"] > 0
    check_logprobs(path, prompts, outs, k=1, prompt_k=1)
