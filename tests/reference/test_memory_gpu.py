"""On a GPU: the KV pool is sized from the workers' profiling steps, so a configuration accepted
at start never runs out of memory mid-serving (the issue's case: 16 prompts of 32K tokens), and
every layout's decode graphs are captured at start-up and then replayed."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import checkpoint, hf_greedy, mixed_prompts

from splash import LLM, SamplingParams
from splash.engine.graphs import batch_buckets
from splash.errors import ConfigError

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
LONG = 32768


@pytest.mark.parametrize("chunk", [None, 16 * LONG])  # the default, and the setting
def test_long_prefills_run_or_are_refused_at_start(chunk):
    path = checkpoint("v3", max_position_embeddings=LONG + 64)
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 256) for _ in range(LONG)] for _ in range(16)]
    try:
        llm = LLM(path, tp_size=1, backend="cuda", max_num_batched_tokens=chunk)
    except ConfigError as e:  # refused at start, naming the knob
        assert "max_num_batched_tokens" in str(e) or "memory_fraction" in str(e)
        return
    with llm:
        memory = llm.stats()["memory"]
        assert memory["measured"] and memory["activation_reserve_gib"] > 0
        outs = llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))
    assert [o.finish_reason for o in outs] == ["length"] * 16


def test_every_layouts_graphs_are_captured_at_start_up():
    path = checkpoint("v3")
    prompts = mixed_prompts()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with LLM(path, tp_size=1, backend="cuda", layout="tp", dtype="fp32", page_size=4,
             max_num_seqs=8) as llm:
        stats = llm.stats()
        assert stats["cuda_graphs_captured"] == 4 * len(batch_buckets(8))
        assert stats["cuda_graph_capture_s"] > 0 and stats["cuda_graph_mib"] >= 0
        # the graphs fit the reserve the pool was sized with (each capture's warm-up once kept
        # a step's activations and a cuBLAS workspace cached on a stream of its own)
        assert stats["cuda_graph_mib"] <= stats["memory"]["graph_reserve_gib"] * 1024
        outs = llm.generate(prompts, params, layout_plan=[(2, "dp"), (4, "dop")])
        assert llm.stats()["graph_steps"] > 0
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, 6)
