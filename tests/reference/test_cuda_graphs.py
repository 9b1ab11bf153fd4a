"""Decode steps replayed from CUDA graphs (one set per layout) give transformers' greedy tokens
and the eager engine's, fp32 on one GPU; graphs are actually used; a layout switch keeps the
other layouts' graphs valid."""

from __future__ import annotations

import pytest
import torch
from tiny_models import checkpoint, hf_greedy, mixed_prompts

from splash import LLM, SamplingParams

pytestmark = pytest.mark.gpu
MAX_NEW = 6


def _run(path, layout, prompts, **kw):
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    with LLM(path, tp_size=1, backend="cuda", layout=layout, dtype="fp32", page_size=4,
             max_num_batched_tokens=16, **kw) as llm:
        outs = llm.generate(prompts, params)
        return [o.token_ids for o in outs], llm.stats()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", ["tp", "dp", "cp", "dop"])
def test_graph_decode_matches_transformers_and_eager(layout):
    path = checkpoint("v3")
    prompts = mixed_prompts()
    graphs, stats = _run(path, layout, prompts)
    assert stats["cuda_graphs"] and stats["graph_steps"] > 0
    eager, stats_e = _run(path, layout, prompts, enforce_eager=True)
    assert stats_e["graph_steps"] == 0
    assert graphs == eager == hf_greedy(path, prompts, MAX_NEW)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphs_survive_layout_switches():
    path = checkpoint("v3")
    prompts = mixed_prompts(lengths=(3, 5, 8))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(path, tp_size=1, backend="cuda", layout="tp", dtype="fp32", page_size=4) as llm:
        outs = llm.generate(prompts, params, layout_plan=[(3, "dp"), (6, "tp"), (9, "dp")])
        stats = llm.stats()
    assert [s["to"] for s in stats["switches"]] == ["dp", "tp", "dp"]
    assert stats["graph_steps"] >= 6
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, 12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", ["tp", "dop"])
def test_dsa_graph_decode_matches_transformers_and_eager(layout):
    """GLM-5 architecture, index_topk 8 below the contexts: graphs capture the indexer, the
    top-k and sparse MLA (fp32 keys: the choice matches transformers')."""
    path = checkpoint("glm-dsa", index_topk=8)
    prompts = mixed_prompts()
    graphs, stats = _run(path, layout, prompts)
    assert stats["graph_steps"] > 0
    eager, _ = _run(path, layout, prompts, enforce_eager=True)
    assert graphs == eager == hf_greedy(path, prompts, MAX_NEW)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphs_stay_valid_across_a_weight_update():
    """Weights are copied into the tensors the graphs were captured with: replays after an
    update compute with the new weights (in every layout's placement the graphs keep), and the
    n samples' copy-on-write pages are copied before a replayed step."""
    import tempfile

    import transformers

    path = checkpoint("v3")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.0)
    new = tempfile.mkdtemp(prefix="splash-graph-weights-")
    model.save_pretrained(new)
    prompts = mixed_prompts(lengths=(3, 5, 8))
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, min_tokens=MAX_NEW)
    with LLM(path, tp_size=1, backend="cuda", layout="tp", dtype="fp32", page_size=4) as llm:
        before = [o.token_ids for o in llm.generate(prompts, params, layout_plan=[(3, "dp")])]
        steps = llm.stats()["graph_steps"]
        llm.update_weights(new)
        after = [o.token_ids for o in llm.generate(prompts, params, layout_plan=[(3, "tp")])]
        forked = llm.generate([prompts[2]], SamplingParams(max_tokens=MAX_NEW, temperature=0.0,
                                                           min_tokens=MAX_NEW, n=3))[0]
        assert llm.stats()["graph_steps"] > steps
    assert before == hf_greedy(path, prompts, MAX_NEW)
    assert after == hf_greedy(new, prompts, MAX_NEW)
    assert [c.token_ids for c in forked.outputs] == [after[2]] * 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", ["tp", "cp", "dop"])
def test_two_stream_layers_match_transformers(layout, monkeypatch):
    """Two streams (the CUDA default): the latent row / query and the shared / routed experts
    on two streams, in graphs and eagerly; the tokens stay transformers'."""
    monkeypatch.setenv("SPLASH_OVERLAP", "")
    path = checkpoint("v3")
    prompts = mixed_prompts()
    graphs, stats = _run(path, layout, prompts)
    assert stats["graph_steps"] > 0
    eager, _ = _run(path, layout, prompts, enforce_eager=True)
    assert graphs == eager == hf_greedy(path, prompts, MAX_NEW)
