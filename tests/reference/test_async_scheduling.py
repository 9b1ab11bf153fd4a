"""Asynchronous scheduling: step N + 1 is scheduled and submitted while step N computes, its
tokens read on the workers from N's draws. The oracles: transformers' greedy tokens, and the
same engine with asynchronous scheduling off (every kind of request must come out the same:
stops found one step late, length stops, min_tokens, seeded sampling, n samples, logprobs,
prefix-cache hits, chunked prefill, preemption, aborts, layout switches)."""

from __future__ import annotations

import pytest
from tiny_models import DEV, checkpoint, hf_greedy, mixed_prompts

from splash import LLM, SamplingParams


def _cases(path: str) -> tuple[list[list[int]], list[SamplingParams], int]:
    """Prompts and parameters of every kind, and how many tokens the stop-token run keeps."""
    prompts = mixed_prompts(seed=3, lengths=(3, 9, 21, 3, 3, 13, 4, 9))
    prompts[3] = prompts[4] = prompts[0]
    prompts[7] = prompts[1][:8] + [7]  # shares two cached pages with prompts[1]
    greedy = hf_greedy(path, prompts[:1], 6)[0]
    stop = greedy[3]  # found only once the step that draws it is done
    # (lengths kept short: 10-16 steps a run; the pool of 14 pages a rank still preempts in
    # the synchronous runs and starves a step scheduled ahead in the asynchronous ones)
    params = [
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.9, seed=7, ignore_eos=True),  # chunked
        SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop]),
        SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop], min_tokens=6),
        SamplingParams(max_tokens=4, temperature=0.7, seed=3, n=2, ignore_eos=True),
        SamplingParams(max_tokens=5, temperature=0.0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
    ]
    return prompts, params, greedy.index(stop) + 1


def _run(path: str, on: bool, **kw):
    prompts, params, _ = _cases(path)
    with LLM(path, async_scheduling=on, page_size=4, max_num_batched_tokens=16, **kw) as llm:
        outs = llm.generate(prompts, params)
        stats = llm.stats()
    return [[(s.token_ids, s.finish_reason, s.logprobs) for s in o.outputs] for o in outs], stats


def _same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        for (tx, fx, lx), (ty, fy, ly) in zip(x, y, strict=True):
            assert (tx, fx) == (ty, fy)
            if lx is not None:
                assert [sorted(d) for d in lx] == [sorted(d) for d in ly]
                for dx, dy in zip(lx, ly):
                    for k in dx:
                        assert dx[k] == pytest.approx(dy[k], abs=1e-4)


def test_every_kind_of_request_matches_synchronous_scheduling_at_t1() -> None:
    path = checkpoint("v3")
    sync, s0 = _run(path, False, backend="cpu")
    got, s1 = _run(path, True, backend="cpu")
    _same(got, sync)
    assert s0["steps_scheduled_ahead"] == 0 and s1["steps_scheduled_ahead"] > 0
    prompts, _, kept = _cases(path)
    assert got[0][0][0] == hf_greedy(path, prompts[:1], 8)[0]  # the independent oracle
    stop_run = got[3][0]
    assert stop_run[1] == "stop" and len(stop_run[0]) == kept  # the extra row was discarded
    assert len(got[5]) == 2 and got[6][0][2] is not None


@pytest.mark.parametrize("layout", ["tp", "dp"])
def test_two_ranks_with_preemption_match_synchronous_scheduling(layout: str) -> None:
    """A pool too small for the batch (the synchronous run preempts): steps scheduled ahead
    never preempt, a request they leave without pages waits for a synchronous step, and
    nothing changes in the tokens."""
    path = checkpoint("v3")
    kw = dict(tp_size=2, layout=layout, kv_pages_per_rank=14, **DEV)
    sync, s0 = _run(path, False, **kw)
    got, s1 = _run(path, True, **kw)
    _same(got, sync)
    assert s0["num_preemptions"] > 0 and s1["steps_scheduled_ahead"] > 0


def test_abort_and_switch_while_a_step_is_in_flight() -> None:
    """An abort between steps (its request still has a row in flight) and a requested switch
    (taking effect after the step in flight) leave the other requests' tokens unchanged."""
    path = checkpoint("v3")
    prompts = mixed_prompts(seed=8, lengths=(5, 11, 7))
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)  # steps after step 4
    want = hf_greedy(path, prompts, params.max_tokens)  # as a run without abort and switch
    with LLM(path, tp_size=2, layout="tp", page_size=4, **DEV) as llm:
        eng = llm.engine
        ids = [eng.add_request(p, params) for p in prompts]
        got: dict[str, list[int]] = {}
        reasons: dict[str, str | None] = {}
        step = 0
        while eng.has_unfinished():
            for out in eng.step():
                got[out.request_id] = out.outputs[0].token_ids
                reasons[out.request_id] = out.outputs[0].finish_reason
            step += 1
            if step == 4:
                eng.abort_request(ids[1])
                eng.switch_layout("dp")
        assert [s["to"] for s in eng.stats()["switches"]] == ["dp"]
        assert eng.stats()["steps_scheduled_ahead"] > 0
    assert reasons[ids[1]] == "abort"
    assert got[ids[1]] == want[1][:len(got[ids[1]])]
    assert got[ids[0]] == want[0] and got[ids[2]] == want[2]
