"""layout="auto" asks the policy when the batch changes and at least every few steps, not on
every step of a steady batch (a decision costs host time on the step it is made)."""

from __future__ import annotations

from tiny_models import checkpoint

from splash.core.request import Request
from splash.engine.auto_layout import AutoLayout
from splash.engine.config import EngineConfig
from splash.engine.setup import build_scheduler, resolve_setup
from splash.sampling_params import SamplingParams


def test_policy_is_asked_when_the_batch_changes() -> None:
    setup = resolve_setup(EngineConfig(model=checkpoint("v3"), tp_size=2, backend="cpu"))
    sched = build_scheduler(setup)
    auto = AutoLayout(setup, sched, margin=0.1, decide_every=4)
    params = SamplingParams(max_tokens=8)
    sched.add(Request("a", [3] * 20, params))

    def asked(step: int) -> bool:
        before = len(auto.decisions)
        auto(step)
        return len(auto.decisions) > before

    assert asked(0)
    assert [asked(s) for s in (1, 2, 3)] == [False] * 3  # same batch: not asked again
    assert asked(4)  # but at least every decide_every steps
    sched.add(Request("b", [4] * 20, params))
    assert asked(5)  # an arrival changes the batch
    assert not asked(6)
    auto.reset()
    assert asked(7) and auto.decisions[0]["step"] == 7
