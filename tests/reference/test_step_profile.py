"""LLMEngine.profile_steps: every worker profiles the marked steps and writes its summary."""

from __future__ import annotations

import json

import pytest
from tiny_models import DEV, checkpoint, mixed_prompts

from splash import LLM, SamplingParams
from splash.errors import InvalidRequestError


def test_every_rank_writes_where_its_steps_went(tmp_path):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(checkpoint("v3"), tp_size=2, layout="tp", page_size=4, **DEV) as llm:
        eng = llm.engine
        for p in mixed_prompts(seed=2, lengths=(4, 6)):
            eng.add_request(p, params)
        eng.step()
        eng.step()
        with pytest.raises(InvalidRequestError, match="steps"):
            eng.profile_steps(0, tmp_path)
        eng.profile_steps(2, tmp_path)
        for _ in range(5):
            eng.step()
    for rank in (0, 1):
        prof = json.loads((tmp_path / f"profile_rank{rank}.json").read_text())
        assert prof["rank"] == rank and prof["steps"] == 2 and prof["first_step"] >= 2
        assert prof["ms_per_step"] > 0 and prof["kernels"]
        assert sum(k["pct"] for k in prof["kernels"]) <= 100.0 + 1e-6
        calls = [k["calls_per_step"] for k in prof["kernels"]]
        assert all(c > 0 for c in calls) and sum(calls) <= prof["calls_per_step"] + 1e-9
