"""Sampling through the whole engine (CPU, tiny DeepSeek-V3), against transformers' logits.

One batch runs every case at once: temperature > 0 alone and with top-k / top-p, a repeated
and a changed seed, and a stop token. Each sampled token is checked against the distribution
a torch reference builds from transformers' logits of the same prefix (teacher forcing): it
must lie in the filtered support, and the randomised probability integral transform of the
draws must look uniform (a wrong temperature or filter skews it). Seeds make the run
deterministic, so the statistical bounds either always hold or always fail.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import checkpoint, hf_greedy

from splash import LLM, SamplingParams

PROMPT = [5, 6, 7]
STEPS = 24
CASES = {  # name -> sampling parameters (seeded)
    "temp": SamplingParams(max_tokens=STEPS, temperature=0.8, seed=11, ignore_eos=True),
    "top_k": SamplingParams(max_tokens=STEPS, temperature=1.5, top_k=4, seed=12,
                            ignore_eos=True),
    "top_p": SamplingParams(max_tokens=STEPS, temperature=1.5, top_p=0.6, seed=13,
                            ignore_eos=True),
    "both": SamplingParams(max_tokens=STEPS, temperature=1.5, top_k=6, top_p=0.8, seed=14,
                           ignore_eos=True),
    "same_seed": SamplingParams(max_tokens=STEPS, temperature=0.8, seed=11, ignore_eos=True),
    "other_seed": SamplingParams(max_tokens=STEPS, temperature=0.8, seed=99, ignore_eos=True),
}
SAMPLED = ("temp", "top_k", "top_p", "both")


@pytest.fixture(scope="module")
def run():
    path = checkpoint("v3")
    greedy = hf_greedy(path, [PROMPT], 8)[0]
    stop = greedy[4]  # finish at its first occurrence
    params = [*CASES.values(), SamplingParams(max_tokens=8, temperature=0.0,
                                              stop_token_ids=[stop])]
    with LLM(path, backend="cpu", layout="tp", page_size=4) as llm:
        outs = llm.generate([PROMPT] * len(params), params)
        alone = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.8, seed=11,
                                                      ignore_eos=True))[0]
    by_name = dict(zip([*CASES, "stop"], outs))
    return {"path": path, "outs": by_name, "alone": alone, "greedy": greedy, "stop": stop}


def _reference_probs(path: str, tokens: list[int], params: SamplingParams) -> torch.Tensor:
    """(STEPS, V): the distribution each generated token was drawn from — softmax of
    transformers' logits / temperature, cut to the top_k most likely, then to the smallest
    most-likely set whose mass reaches top_p (torch reference, written here)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1: -1]
    probs = (logits / params.temperature).softmax(-1)
    out = torch.zeros_like(probs)
    for i, row in enumerate(probs):
        p, order = row.sort(descending=True)
        keep = len(p) if params.top_k == 0 else params.top_k
        p = p[:keep] / p[:keep].sum()
        mass_before = p.cumsum(0) - p
        p = p[mass_before < params.top_p]
        out[i, order[: len(p)]] = p / p.sum()
    return out


@pytest.mark.parametrize("name", SAMPLED)
def test_samples_lie_in_the_filtered_support(run, name):
    params, tokens = CASES[name], run["outs"][name].token_ids
    assert len(tokens) == STEPS
    probs = _reference_probs(run["path"], tokens, params)
    for i, t in enumerate(tokens):
        assert probs[i, t] > 0, f"step {i}: token {t} is outside the top-k / top-p set"
    if params.top_k:
        assert all(int((row > 0).sum()) <= params.top_k for row in probs)


def test_draws_follow_the_reference_distribution(run):
    """Randomised PIT with tokens ranked most likely first: u = P(more likely than t) +
    V * p(t) is uniform on (0, 1) when t ~ p. Pooled over the sampled cases (96 draws), the
    Kolmogorov-Smirnov distance stays under the 0.1% critical value; a sampler that is too
    sharp (greedy, a lower temperature) or too flat (a higher one, an ignored filter) puts
    the draws' u near 0 or near 1 and exceeds it."""
    g = torch.Generator().manual_seed(0)
    us = []
    for name in SAMPLED:
        tokens = run["outs"][name].token_ids
        probs = _reference_probs(run["path"], tokens, CASES[name])
        for i, t in enumerate(tokens):
            below = probs[i][probs[i] > probs[i, t]].sum()
            us.append(float(below + torch.rand((), generator=g) * probs[i, t]))
    u = torch.tensor(sorted(us))
    n = len(u)
    ecdf_hi = torch.arange(1, n + 1) / n
    ecdf_lo = torch.arange(0, n) / n
    ks = float(torch.maximum(ecdf_hi - u, u - ecdf_lo).max())
    assert ks < 1.95 / n ** 0.5, f"KS distance {ks:.3f} over {n} draws"
    assert len({tuple(run["outs"][n_].token_ids) for n_ in SAMPLED}) == len(SAMPLED)


def test_seeds_reproduce_whatever_the_batch(run):
    outs = run["outs"]
    assert outs["same_seed"].token_ids == outs["temp"].token_ids
    assert run["alone"].token_ids == outs["temp"].token_ids[:8]  # alone vs in a batch of 7
    assert outs["other_seed"].token_ids != outs["temp"].token_ids


def test_stop_token_finishes_the_request(run):
    out, greedy, stop = run["outs"]["stop"], run["greedy"], run["stop"]
    end = greedy.index(stop) + 1
    assert out.token_ids == greedy[:end]
    assert out.finished and out.finish_reason == "stop"
