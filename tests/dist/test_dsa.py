"""DeepSeek Sparse Attention across ranks (gloo): tiny GLM-5 and DeepSeek-V3.2 architectures
whose index_topk (8) is below the contexts (up to 30 tokens), so every layer attends a true
top-k selection. Every layout, at T=2 and T=4, gives transformers' greedy tokens (CP's position-sharded pick
merges the ranks' candidates), and so do runs switching live along all 12 directions and in
the background along four, in which the indexer keys move with their pages."""

from __future__ import annotations

import dataclasses

import pytest
from tiny_models import DEV, checkpoint, hf_greedy, mixed_prompts

from splash import LLM, SamplingParams
from splash.core.shapes import BatchShape

PROMPTS = mixed_prompts(seed=1, lengths=(3, 11, 26))
MAX_NEW = 4
TOPK = 8
PARAMS = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
_REF: dict = {}


def reference(arch):
    if arch not in _REF:
        _REF[arch] = hf_greedy(checkpoint(arch, index_topk=TOPK), PROMPTS, MAX_NEW)
    return _REF[arch]


@pytest.mark.parametrize("arch,world,layouts", [("glm-dsa", 2, ("tp", "dp", "cp", "dop")),
                                                ("v32", 4, ("cp", "tp", "dp", "dop"))])
def test_dsa_layouts_match_transformers(arch, world, layouts):
    """One engine, one whole generate per layout (switched to while idle)."""
    with LLM(checkpoint(arch, index_topk=TOPK), tp_size=world, **DEV, layout=layouts[0],
             page_size=4, max_num_batched_tokens=16) as llm:
        for layout in layouts:
            llm.switch_layout(layout)
            outs = llm.generate(PROMPTS, PARAMS)
            assert llm.stats()["layout"] == layout
            assert [o.token_ids for o in outs] == reference(arch), layout
        assert llm.stats()["kv_pages_used"] == [0] * world


CIRCUIT = ["tp", "dp", "tp", "cp", "tp", "dop", "dp", "cp", "dp", "dop", "cp", "dop", "tp"]


# background: a pre-copy while the source layout still computes, then the handoff moves the rows
# (and indexer keys) written since; a switch then takes three steps, so fewer directions (an
# all-to-all, an all-gather, a repack and a head all-gather)
@pytest.mark.parametrize("mode,circuit,gap", [("live", CIRCUIT, 1),
                                              ("background", ["tp", "cp", "dop", "tp", "dp"], 3)])
def test_dsa_switch_directions_token_identical(mode, circuit, gap):
    path = checkpoint("glm-dsa", index_topk=TOPK)
    # the 10-token request decodes past index_topk while the 30-token prompt is prefilled in
    # chunks: each switch step carries sparse decodes and a chunked prefill
    prompts = mixed_prompts(seed=12, lengths=(10, 3, 30))
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (14, 14, 3)]
    plan = [(1 + gap * i, dst) for i, dst in enumerate(circuit[1:])]
    with LLM(path, tp_size=2, layout=circuit[0], **DEV, page_size=4, switch_mode=mode,
             max_num_batched_tokens=8) as llm:
        switched = llm.generate(prompts, params, layout_plan=plan)
        stats = llm.stats()
    # the run without switches gives transformers' tokens (test_dsa_layout_matches_transformers)
    want = hf_greedy(path, prompts, 14)
    assert [o.token_ids for o in switched] == [w[:n] for w, n in zip(want, (14, 14, 3))]
    assert [(s["from"], s["to"]) for s in stats["switches"]] == list(zip(circuit, circuit[1:]))
    assert {s["mode"] for s in stats["switches"]} == {mode}
    for s in stats["switches"]:  # KV rows carry their indexer keys: the prediction counts them
        assert s["kv_bytes_received_per_rank"] == s["predicted_kv_bytes_per_rank"], s
    assert any(s["kv_bytes_received"] for s in stats["switches"])



def test_dsa_under_auto_follows_the_sparse_cost_model():
    """layout="auto" on a DSA model: the policy's cost model is the sparse one the engine runs
    (attention bounded by index_topk, indexer keys counted in each token's KV), and the tokens
    are transformers'."""
    arch = "glm-dsa"
    with LLM(checkpoint(arch, index_topk=TOPK), tp_size=2, **DEV, layout="auto",
             page_size=4, max_num_batched_tokens=16) as llm:
        cm = llm.engine.auto.policy.cost_model
        assert cm.kv_bytes_per_token_per_layer > cm.memory.kv_bytes_per_token_per_layer
        dense = dataclasses.replace(cm, sparse_attention=False)

        def growth(model):  # attention time from an 8 x top-k to a 64 x top-k context
            short, long = (model.breakdown("tp", BatchShape.decode(1, n))["attention"]
                           for n in (8 * TOPK, 64 * TOPK))
            return long - short

        # top-k: the same tokens attended at any context; only the indexer's scoring grows
        assert 0 <= growth(cm) < growth(dense) / 2
        assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == reference(arch)
