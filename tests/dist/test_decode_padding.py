"""Decode steps padded with ghost rows, as CUDA graphs replay them (splash/engine/graphs.py),
give transformers' greedy tokens in every layout: ghosts write no KV, attend nothing and are
never sampled, and owner-held layouts pad every rank to the same row count. On CPU the padded
steps run eagerly (SPLASH_PAD_DECODE=1); the graph capture itself is tested on the GPU
(tests/reference/test_cuda_graphs.py)."""

from __future__ import annotations

import pytest

from splash import LLM, SamplingParams
from tiny_models import DEV, checkpoint, hf_greedy, mixed_prompts

MAX_NEW = 5


@pytest.mark.parametrize("world,layout,arch", [(1, "tp", "v3"), (2, "tp", "v3"), (2, "dp", "v3"),
                                               (2, "cp", "v3"), (2, "dop", "v3"),
                                               (2, "cp", "glm-dsa")])
def test_padded_decode_matches_transformers(monkeypatch, world, layout, arch):
    """(glm-dsa: index_topk 8 below the contexts; the padded table width decides sparse vs
    dense, and CP's two-round pick sees ghost rows with empty histories.)"""
    monkeypatch.setenv("SPLASH_PAD_DECODE", "1")
    path = checkpoint(arch, **({"index_topk": 8} if arch == "glm-dsa" else {}))
    prompts = mixed_prompts()  # 5 requests: padded to 8 (T=1) or 2 x 4 rows (owner layouts)
    # different lengths: the batch shrinks as requests finish, crossing bucket sizes
    params = [SamplingParams(max_tokens=MAX_NEW - i % 3, temperature=0.0, ignore_eos=True)
              for i in range(len(prompts))]
    with LLM(path, tp_size=world, **DEV, layout=layout, page_size=4,
             max_num_batched_tokens=16) as llm:
        outs = llm.generate(prompts, params)
        assert llm.stats()["kv_pages_used"] == [0] * world
    ref = hf_greedy(path, prompts, MAX_NEW)
    assert [o.token_ids for o in outs] == [r[: p.max_tokens] for r, p in zip(ref, params)]
