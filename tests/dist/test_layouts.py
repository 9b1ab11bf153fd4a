"""T ranks as real processes over gloo: TP, DP-attention, CP and DOP give the same greedy
tokens as T=1 and as transformers, on mixed batches, idle ranks, chunked prefill and
preemption."""

from __future__ import annotations

import os
import signal
import time

import pytest

from splash import LLM, SamplingParams
from splash.errors import LayoutInfeasibleError, WorkerDiedError
from tiny_models import DEV, checkpoint, hf_greedy, mixed_prompts

MAX_NEW = 5
PARAMS = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
_REF: dict = {}


def reference(arch, prompts):
    key = (arch, tuple(map(tuple, prompts)))
    if key not in _REF:
        _REF[key] = hf_greedy(checkpoint(arch), prompts, MAX_NEW)
    return _REF[key]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout", ["tp", "dp", "cp", "dop"])
def test_layout_matches_transformers(layout, world):
    path = checkpoint("v3")
    prompts = mixed_prompts()  # 5 requests: not divisible by T; 1..37 tokens
    with LLM(path, tp_size=world, **DEV, layout=layout, page_size=4,
             max_num_batched_tokens=16) as llm:
        outs = llm.generate(prompts, PARAMS)
        assert [o.token_ids for o in outs] == reference("v3", prompts)
        one = llm.generate(prompts[2:3], PARAMS)  # a batch smaller than T: idle ranks
        assert one[0].token_ids == reference("v3", prompts)[2]
        stats = llm.stats()
        assert stats["layout"] == layout and stats["kv_pages_used"] == [0] * world
        caps = stats["kv_capacity_tokens"]
        assert caps["dop"] >= caps["cp"] and caps["dp"] > caps["tp"]


def test_preemption_across_ranks():
    path = checkpoint("v3")
    prompts = mixed_prompts(seed=5, lengths=(9, 10, 11, 12, 13, 14))
    with LLM(path, tp_size=2, **DEV, layout="dop", page_size=4, kv_pages_per_rank=10,
             max_num_batched_tokens=64) as llm:
        outs = llm.generate(prompts, PARAMS)
        assert llm.stats()["num_preemptions"] > 0
    assert [o.token_ids for o in outs] == reference("v3", prompts)


def test_heads_not_divisible_names_the_layouts_that_fit():
    path = checkpoint("v3", num_attention_heads=6, num_key_value_heads=6)
    with pytest.raises(LayoutInfeasibleError, match=r"\['dp', 'cp'\]"):
        LLM(path, tp_size=4, **DEV, layout="dop")


def test_dead_worker_fails_generate_fast():
    path = checkpoint("v3")
    with LLM(path, tp_size=2, **DEV, layout="tp", page_size=4) as llm:
        eng = llm.engine
        eng.add_request(mixed_prompts()[4], SamplingParams(max_tokens=50, ignore_eos=True))
        eng.step()
        os.kill(eng.stats()["worker_pids"][1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError):
            for _ in range(100):
                eng.step()
        assert time.monotonic() - t0 < 10
        assert not eng.is_healthy()
