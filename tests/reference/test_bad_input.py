"""Bad input gets a clear SplashError and loses nothing: the engine keeps serving."""

from __future__ import annotations

import pytest
from tiny_models import checkpoint, hf_greedy

from splash import LLM, SamplingParams
from splash.engine.worker import Worker
from splash.errors import InvalidRequestError, SplashError


@pytest.fixture(scope="module")
def llm():
    with LLM(checkpoint("v3"), tp_size=1, backend="cpu", layout="tp", page_size=4,
             max_model_len=64) as engine:
        yield engine


@pytest.mark.parametrize("prompt,params,match", [
    ([], SamplingParams(max_tokens=2), "non-empty"),
    ([1, 256], SamplingParams(max_tokens=2), "vocab"),
    ([1, -3], SamplingParams(max_tokens=2), "vocab"),
    ([1, 2.5], SamplingParams(max_tokens=2), "int"),
    (list(range(2, 62)), SamplingParams(max_tokens=8), "max_model_len 64"),
    ([5, 6], SamplingParams(max_tokens=2, stop=["ab"]), "stop strings need a tokenizer"),
    ([5, 6], SamplingParams(max_tokens=2, n=300), "max_num_seqs"),
])
def test_bad_requests_raise_and_engine_keeps_serving(llm, prompt, params, match):
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate([prompt], params)
    good = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0,
                                                    ignore_eos=True))
    assert good[0].token_ids == hf_greedy(checkpoint("v3"), [[5, 6, 7]], 3)[0]
    assert llm.stats()["num_waiting"] == 0 and llm.stats()["kv_pages_used"] == [0]


@pytest.mark.parametrize("kw,match", [
    (dict(n=0), "n must"), (dict(logprobs=21), "logprobs must"),
    (dict(prompt_logprobs=-1), "prompt_logprobs must"), (dict(stop=[""]), "stop must"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens must"),
])
def test_bad_sampling_params(kw, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kw)


@pytest.mark.parametrize("rid", ["", "\x00ghost-0", "a\nb"])
def test_request_ids_must_be_printable(llm, rid):
    """Control characters are reserved for the engine's own padding rows (CUDA graphs)."""
    with pytest.raises(InvalidRequestError, match="printable"):
        llm.engine.add_request([1, 2], SamplingParams(max_tokens=1), request_id=rid)
    assert llm.stats()["num_waiting"] == 0


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-1), "max_tokens"),
    (dict(temperature=-0.5), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"),
    (dict(temperature=float("nan")), "temperature"),
])
def test_invalid_sampling_values(kwargs, match):
    with pytest.raises(SplashError, match=match):
        SamplingParams(**kwargs)


def test_unknown_layout_is_a_clear_error(llm):
    with pytest.raises(ValueError, match="unknown layout"):
        llm.switch_layout("zigzag")


def test_dsa_model_serves_to_max_position_embeddings():
    """GLM-5 architecture with index_topk 8: contexts run to max_position_embeddings (256);
    the pool holds an indexer key per token in each indexer layer, as the memory model counts."""
    with LLM(checkpoint("glm-dsa", index_topk=8), backend="cpu", layout="tp",
             page_size=4) as glm:
        setup = glm.engine.setup
        assert setup.max_model_len == 256
        worker = Worker(setup.worker_config())
        worker.allocate(setup.num_pages)
        store = worker.store  # what each worker allocates
        pools = [t for i in range(2) for t in store.slot_pools(i)]
        assert sum(t.nbytes for t in pools) == setup.memory.page_bytes * setup.num_pages
        assert store.index_caches[1] is None  # layer 1 reuses layer 0's selection
        with pytest.raises(InvalidRequestError, match="max_model_len 256"):
            glm.generate([list(range(2, 252))], SamplingParams(max_tokens=8))
        ok = glm.generate([list(range(2, 14))], SamplingParams(max_tokens=2, ignore_eos=True))
        assert len(ok[0].token_ids) == 2
