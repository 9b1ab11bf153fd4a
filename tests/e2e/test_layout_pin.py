"""Under layout="auto" a manual switch pins its layout until switch_layout("auto") releases it
(the policy is not consulted meanwhile); a switch entry reports what the switch cost: the time
the workers spent on its transfers, never the gap between two unlike steps."""

from __future__ import annotations

import pytest
from tiny_models import DEV, checkpoint, mixed_prompts

from splash import LLM, SamplingParams
from splash.errors import ConfigError

pytestmark = pytest.mark.timeout(300)


def _run(eng, steps: int) -> list[str]:
    layouts = []
    for _ in range(steps):
        eng.step()
        layouts.append(eng.layout)
    return layouts


def test_manual_switch_pins_under_auto() -> None:
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    with LLM(checkpoint("v3"), tp_size=2, layout="auto", page_size=4, **DEV) as llm:
        eng = llm.engine
        for p in mixed_prompts(seed=5, lengths=(3, 4, 5, 6)):
            eng.add_request(p, params)
        _run(eng, 3)
        unpinned = [d["step"] for d in eng.stats()["policy_decisions"]]
        assert unpinned, "the policy decides every step while nothing is pinned"
        target = "dop" if eng.layout != "dop" else "dp"
        llm.switch_layout(target)
        assert llm.stats()["layout_pinned"] == target
        seen = _run(eng, 6)  # six steps the policy, unpinned, would each have decided
        assert seen == [target] * 6, seen
        assert [d["step"] for d in eng.stats()["policy_decisions"]] == unpinned
        llm.switch_layout("auto")  # release: the policy decides again
        assert llm.stats()["layout_pinned"] is None
        _run(eng, 2)
        assert len(eng.stats()["policy_decisions"]) > len(unpinned)


def test_switch_cost_is_the_switch_work() -> None:
    """A switch while a prompt is prefilled (the next step is unlike it) and one in steady
    decode (the next step decodes the same requests): both report the switch work; only the
    matched one reports the switching step's excess over the destination's ready step. (The
    engine is not an auto one: releasing a pin with switch_layout("auto") is refused first.)"""
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = mixed_prompts(seed=1, lengths=(3, 30))
    with LLM(checkpoint("v3"), tp_size=2, layout="tp", page_size=4, max_num_batched_tokens=8,
             **DEV) as llm:
        with pytest.raises(ConfigError, match="auto"):  # auto release needs an auto engine
            llm.switch_layout("auto")
        llm.generate(prompts, params, layout_plan=[(1, "dp"), (6, "tp")])
        first, second = llm.stats()["switches"]
    assert (first["from"], first["to"], second["to"]) == ("tp", "dp", "tp")
    for s in (first, second):
        assert 0 < s["overhead_ms"] <= s["step_ms"], s
    assert "step_minus_ready_ms" not in first  # steps 1 and 2 prefill: not comparable
    assert second["step_minus_ready_ms"] == pytest.approx(
        second["step_ms"] - second["ready_step_ms"], abs=1e-3)
