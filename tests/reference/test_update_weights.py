"""In-place weight updates: after ``update_weights`` the engine gives exactly the tokens of the
new checkpoint (transformers' greedy tokens as the oracle) — from a checkpoint directory, from
a partial {name: tensor} mapping (the rest keeps its values), at T=1 and over two ranks after a
switch (every held placement is rebuilt); the prefix cache is flushed; requests in flight and
mismatched tensors are refused without changing anything."""

from __future__ import annotations

import tempfile

import pytest
import torch
from tiny_models import DEV, checkpoint, hf_greedy, mixed_prompts

from splash import LLM, SamplingParams
from splash.errors import ConfigError, InvalidRequestError

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, min_tokens=6)  # as hf_greedy


def _variant(base: str, seed: int, only: str | None = None) -> tuple[str, dict]:
    """A checkpoint like ``base`` with perturbed weights (those whose name contains ``only``);
    returns its directory and the changed tensors."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    changed = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if only is None or only in name:
                p.add_(0.3 * p.std() * torch.randn(p.shape, generator=g))
                changed[name] = p.detach().clone()
    path = tempfile.mkdtemp(prefix="splash-variant-")
    model.save_pretrained(path)
    return path, changed


def test_update_from_directory_and_partial_mapping():
    base = checkpoint("v3")
    new_dir, _ = _variant(base, seed=5)
    part_dir, part = _variant(base, seed=6, only="layers.1.")  # attention + MoE of layer 1
    prompts = mixed_prompts(seed=12, lengths=(5, 11))
    with LLM(base, tp_size=1, backend="cpu", layout="tp", page_size=4) as llm:
        before = [o.token_ids for o in llm.generate(prompts, PARAMS)]
        assert llm.stats()["prefix_cache_pages"] != [0]
        info = llm.update_weights(new_dir)
        assert info["weight_version"] == 1 and llm.stats()["prefix_cache_pages"] == [0]
        after = [o.token_ids for o in llm.generate(prompts, PARAMS)]
        assert llm.stats()["prefix_cache_hit_tokens"] == 0  # old KV is never reused
        llm.update_weights(base)
        assert [o.token_ids for o in llm.generate(prompts, PARAMS)] == before
        llm.update_weights(part)  # only layer 1 changes
        partial = [o.token_ids for o in llm.generate(prompts, PARAMS)]
    assert before == hf_greedy(base, prompts, 6)
    assert after == hf_greedy(new_dir, prompts, 6) != before
    assert partial == hf_greedy(part_dir, prompts, 6) != before


def test_update_over_two_ranks_after_a_switch_and_refusals():
    base = checkpoint("v3")
    new_dir, changed = _variant(base, seed=7)
    prompts = mixed_prompts(seed=13, lengths=(4, 9, 3))
    with LLM(base, tp_size=2, layout="tp", page_size=4, **DEV) as llm:
        llm.generate(prompts, PARAMS, layout_plan=[(1, "dp")])  # now DP: replicated heads
        eng = llm.engine
        rid = eng.add_request(prompts[0], PARAMS)
        with pytest.raises(InvalidRequestError, match="in flight"):
            llm.update_weights(new_dir)
        eng.abort_request(rid)
        eng.step()
        with pytest.raises(InvalidRequestError, match="no tensor"):
            llm.update_weights({"model.layers.9.mlp.gate.weight": torch.zeros(8, 64)})
        name = "model.layers.0.self_attn.o_proj.weight"
        with pytest.raises(InvalidRequestError, match="shape"):
            llm.update_weights({name: changed[name][:, :8]})
        with pytest.raises(ConfigError, match="architecture"):
            llm.update_weights(checkpoint("v2"))
        llm.update_weights(changed)  # every tensor, through a temporary file to the workers
        dp = [o.token_ids for o in llm.generate(prompts, PARAMS)]
        tp = [o.token_ids for o in llm.generate(prompts, PARAMS, layout_plan=[(0, "tp")])]
        assert llm.stats()["layout"] == "tp"
    assert dp == tp == hf_greedy(new_dir, prompts, 6)
