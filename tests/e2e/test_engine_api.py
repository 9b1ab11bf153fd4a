"""EngineAPI conformance: the serving tests' stand-in engine and the real engine (CPU, tiny
DeepSeek-V3 checkpoint) answer the same calls the same way, so what the fast server tests
check against the stand-in holds for the engine `splash serve` runs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from serve_helpers import FakeEngine
from tiny_models import checkpoint

from splash.engine.api import EngineAPI
from splash.engine.config import EngineConfig
from splash.engine.llm_engine import LLMEngine
from splash.errors import InvalidRequestError
from splash.outputs import RequestOutput
from splash.sampling_params import SamplingParams

MAX_LEN = 64
STATS_KEYS = {"layout", "switches", "kv_capacity_tokens", "kv_pages_used", "kv_pages_total",
              "num_waiting", "num_running", "step_time_ms_ema", "tokens_per_s", "worker_pids"}


@pytest.fixture(params=["fake", "real"])
def engine(request: pytest.FixtureRequest) -> Iterator[EngineAPI]:
    if request.param == "fake":
        eng: EngineAPI = FakeEngine(vocab_size=256, max_model_len=MAX_LEN)
    else:
        eng = LLMEngine(EngineConfig(model=checkpoint("v3"), backend="cpu", layout="tp",
                                     page_size=4, max_model_len=MAX_LEN))
    yield eng
    eng.shutdown()


def _drain(engine: EngineAPI, max_steps: int = 200) -> list[RequestOutput]:
    outs: list[RequestOutput] = []
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outs
        outs += engine.step()
    raise AssertionError("the engine did not finish its requests")


def test_engine_api_conformance(engine: EngineAPI) -> None:
    assert isinstance(engine, EngineAPI)
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    rid = engine.add_request([5, 6, 7], greedy, request_id="a")
    assert rid == "a"
    # bad requests raise InvalidRequestError and change nothing
    for prompt, params, rid_ in (([], greedy, None), ([5, 6], greedy, "a"),
                                 ([300], greedy, None),
                                 ([5], SamplingParams(max_tokens=MAX_LEN), None)):
        with pytest.raises(InvalidRequestError):
            engine.add_request(prompt, params, request_id=rid_)
    with pytest.raises(InvalidRequestError, match="unknown layout"):
        engine.switch_layout("zigzag")
    long = engine.add_request([8, 9], SamplingParams(max_tokens=40, ignore_eos=True))
    assert long != rid and engine.has_unfinished()
    with pytest.raises(InvalidRequestError, match="in flight"):
        engine.update_weights({})  # never while requests run

    first = engine.step()
    assert {o.request_id for o in first} == {rid, long}
    assert all(len(o.new_token_ids) == 1 and not o.finished for o in first)
    assert engine.abort_request(long) is True
    assert engine.abort_request(long) is False and engine.abort_request("nope") is False
    engine.switch_layout("dop")
    outs = first + _drain(engine)

    by_id: dict[str, list[RequestOutput]] = {}
    for o in outs:
        by_id.setdefault(o.request_id, []).append(o)
    done = by_id[rid][-1]
    assert done.finished and done.finish_reason == "length" and len(done.token_ids) == 3
    assert sum((o.new_token_ids for o in by_id[rid]), []) == done.token_ids
    assert [o.finished for o in by_id[rid]] == [False, False, True]
    aborted = [o for o in by_id[long] if o.finished]
    assert len(aborted) == 1 and aborted[0].finish_reason == "abort"
    assert by_id[long][-1] is aborted[0]

    stats = engine.stats()
    assert STATS_KEYS <= set(stats) and stats["layout"] == "dop"
    assert not any(stats["kv_pages_used"]) and stats["num_running"] == 0
    assert engine.is_healthy() and not engine.has_unfinished()
