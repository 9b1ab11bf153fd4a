"""The prefix cache survives layout switches (T=2): histories cached in one layout, no longer
held by any request, move with the switch to their holders in the next and are hits there;
tokens stay transformers' greedy tokens and moved bytes match the manifest's prediction."""

from __future__ import annotations

from tiny_models import DEV, checkpoint, hf_greedy, mixed_prompts

from splash import LLM, SamplingParams


def test_cached_pages_move_with_each_switch_and_stay_hits():
    path = checkpoint("v3")
    shared = mixed_prompts(seed=31, lengths=(17,))[0]  # 4 full pages of 4
    tails = mixed_prompts(seed=32, lengths=(2, 3, 1, 4, 2))
    params = SamplingParams(max_tokens=3, temperature=0.0, min_tokens=3)  # as hf_greedy
    outs, hits = [], []
    with LLM(path, tp_size=2, layout="dp", page_size=4, max_num_batched_tokens=32,
             **DEV) as llm:
        for layout, tail in zip(["dp", "tp", "cp", "dop", "dp"], tails):
            if layout != llm.stats()["layout"]:
                llm.switch_layout(layout)  # happens at the next step, with the request
            before = llm.stats()["prefix_cache_hit_tokens"]
            outs.append(llm.generate([shared + tail], params)[0].token_ids)
            hits.append(llm.stats()["prefix_cache_hit_tokens"] - before)
        stats = llm.stats()
    assert [(s["from"], s["to"]) for s in stats["switches"]] == [
        ("dp", "tp"), ("tp", "cp"), ("cp", "dop"), ("dop", "dp")]
    assert hits == [0, 16, 16, 16, 16]
    for s in stats["switches"]:
        assert s["kv_bytes_received_per_rank"] == s["predicted_kv_bytes_per_rank"], s
    assert stats["switches"][0]["kv_bytes_received"] > 0  # dp -> tp gathers the cached chain
    assert outs == hf_greedy(path, [shared + t for t in tails], 3)
    assert stats["kv_pages_used"] == [0, 0]


def test_copies_a_switch_left_behind_are_reused_not_moved():
    """TP -> DP leaves each request's pages cached on its non-owner rank. The DP -> TP switch
    after it takes those copies back (same keys) and receives only the pages written since,
    fewer bytes than the same run without prefix caching — not the copies moved along as
    cached chains as well — and the tokens are the same."""
    path = checkpoint("v3")
    prompts = mixed_prompts(seed=33, lengths=(17, 21, 9, 13))
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    runs = []
    for caching in (True, False):
        with LLM(path, tp_size=2, layout="tp", page_size=4, max_num_batched_tokens=64,
                 enable_prefix_caching=caching, **DEV) as llm:
            outs = llm.generate(prompts, params, layout_plan=[(3, "dp"), (6, "tp")])
            runs.append(([o.token_ids for o in outs], llm.stats()["switches"]))
    (cached_tokens, cached), (plain_tokens, plain) = runs
    assert cached_tokens == plain_tokens
    assert [(s["from"], s["to"]) for s in cached] == [("tp", "dp"), ("dp", "tp")]
    back, back_plain = cached[1], plain[1]
    assert back["kv_bytes_received_per_rank"] == back["predicted_kv_bytes_per_rank"]
    assert all(n > 0 for n in back["kv_pages_reused_per_rank"])
    assert back_plain["kv_pages_reused_per_rank"] == [0, 0]
    assert 0 < back["kv_bytes_received"] < back_plain["kv_bytes_received"]
