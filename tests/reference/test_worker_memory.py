"""A worker's memory at start-up and under failure: the profiling steps run the largest prefill
chunk and decode batch over a one-page pool in every layout; an out-of-memory error in a
single-rank worker fails only that step's requests (the others get the tokens of a run without
the fault: transformers' greedy tokens) and the engine serves on; in a multi-rank group it
ends the group promptly."""

from __future__ import annotations

import pytest
from tiny_models import checkpoint, hf_greedy

from splash import LLM, SamplingParams
from splash.core.ownership import LAYOUTS, num_local_pages
from splash.engine.config import EngineConfig
from splash.engine.profiling import PROFILE_CONTEXT, profile_plans, profile_tables
from splash.engine.setup import resolve_setup
from splash.engine.worker import Worker
from splash.errors import WorkerDiedError

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
PROMPTS = {"a": [3, 4, 5, 6], "b": [7, 8, 9], "c": [10, 11, 12, 13, 14], "d": [15, 16]}


@pytest.mark.parametrize("layout", ["tp", "dp", "cp", "dop"])
def test_profiling_plans_hold_the_largest_steps(layout):
    plans = profile_plans(layout, 2, prefill_rows=24, decode_rows=5, context=40)
    prefill, decode = plans
    assert prefill.query_lens == [24] and prefill.context_lens == [40]
    assert prefill.positions == list(range(16, 40))
    assert decode.query_lens == [1] * 5 and decode.sample == [True] * 5
    assert decode.positions == [39] * 5
    for rank in range(2):
        tables = profile_tables(decode, rank, 2, page_size=4)
        want = num_local_pages(LAYOUTS[layout], 10, rank, 0, 2)
        assert all(t == [0] * want for t in tables.values())  # every entry: the one page
    long_chunk, _ = profile_plans(layout, 2, prefill_rows=100, decode_rows=1, context=40)
    assert long_chunk.query_lens == [40, 40, 20]  # positions stay inside the context
    assert long_chunk.positions == [*range(40), *range(40), *range(20, 40)]
    # a context beyond PROFILE_CONTEXT runs at PROFILE_CONTEXT: no buffer grows past it
    capped, dec = profile_plans(layout, 2, prefill_rows=24, decode_rows=2, context=10**6)
    assert capped.context_lens == [PROFILE_CONTEXT] and dec.positions == [PROFILE_CONTEXT - 1] * 2


def test_profiling_steps_run_over_one_page():
    """Through the real kernels (CPU: interpreter, nothing measured): the worker frees the
    profiling pool and then allocates the pool the controller sized."""
    setup = resolve_setup(EngineConfig(checkpoint("v3"), backend="cpu", page_size=4,
                                       max_num_batched_tokens=12, max_num_seqs=3))
    worker = Worker(setup.worker_config())
    assert worker.profile() == (0, 0)  # nothing reports memory on the CPU
    assert worker.store.caches[0].shape[0] == 0 and not worker.tables
    ready = worker.allocate(7)
    assert ready.num_pages == 7 and worker.store.caches[0].shape[0] == 7


def _serve(llm, rids_first, rids_later, steps_before):
    eng = llm.engine
    for rid in rids_first:
        eng.add_request(PROMPTS[rid], GREEDY, request_id=rid)
    outs = {}
    for _ in range(steps_before):
        for out in eng.step():
            outs[out.request_id] = out
    for rid in rids_later:
        eng.add_request(PROMPTS[rid], GREEDY, request_id=rid)
    while eng.has_unfinished():
        for out in eng.step():
            outs[out.request_id] = out
    return outs


def test_out_of_memory_fails_only_that_steps_requests(monkeypatch):
    path = checkpoint("v3")
    kw = dict(tp_size=1, backend="cpu", page_size=4, max_num_seqs=2)
    # the tokens of a run without the fault: transformers' greedy tokens (GREEDY ignores EOS)
    clean = dict(zip("cd", hf_greedy(path, [PROMPTS["c"], PROMPTS["d"]], GREEDY.max_tokens)))
    monkeypatch.setenv("SPLASH_TEST_OOM_STEP", "2")  # a's and b's decode step
    with LLM(path, **kw) as llm:
        faulty = _serve(llm, "abc", "d", 3)
        assert llm.engine.is_healthy()
        stats = llm.stats()
    for rid in "ab":
        assert faulty[rid].finished and faulty[rid].finish_reason == "error"
        assert "OutOfMemoryError" in faulty[rid].error
    for rid in "cd":  # waiting at the fault (max_num_seqs 2) / added after it
        assert faulty[rid].finish_reason == "length"
        assert faulty[rid].outputs[0].token_ids == clean[rid]
    assert stats["kv_pages_used"] == [0]  # the failed requests gave their pages back


def test_out_of_memory_in_a_group_ends_it_without_hanging(monkeypatch):
    monkeypatch.setenv("SPLASH_TEST_OOM_STEP", "1")  # rank 0 fails; rank 1 waits in a collective
    with LLM(checkpoint("v3"), tp_size=2, backend="cpu", layout="tp", page_size=4) as llm:
        eng = llm.engine
        eng.add_request(PROMPTS["a"], GREEDY, request_id="a")
        eng.step()
        with pytest.raises(WorkerDiedError, match="OutOfMemoryError"):
            eng.step()
        assert not eng.is_healthy()
        with pytest.raises(WorkerDiedError):
            eng.step()
