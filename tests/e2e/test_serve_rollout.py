"""Rollout features through the servers against the real engine (T=1, a checkpoint with a
byte-level tokenizer, in-process servers). OpenAI API: stop strings cut the text the same way
streamed and not (the stop string never reaches a stream), chat logprobs have OpenAI's shape
and the engine's values, n > 1 answers n choices and refuses to stream. ZeroMQ: a weight update
is refused while a request streams, then changes the outputs to the new checkpoint's."""

from __future__ import annotations

import json
import tempfile
import time
import urllib.error
import urllib.request

import pytest
from serve_helpers import thread_server
from tiny_models import checkpoint, hf_greedy, mixed_prompts
from tiny_tokenizer import add_tokenizer

from splash.client import Client
from splash.engine.llm_engine import LLMEngine
from splash.errors import InvalidRequestError
from splash.sampling_params import SamplingParams
from splash.server.http import OpenAIHTTPServer

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def http():
    engine = LLMEngine.from_args(model=add_tokenizer(checkpoint("v3")), tp_size=1,
                                 backend="cpu", layout="tp", page_size=4)
    with thread_server(engine) as server:
        front = OpenAIHTTPServer("127.0.0.1", 0, server.inproc_endpoint, server.context, None,
                                 engine.tokenizer, "tiny")
        front.start()
        try:
            yield f"http://127.0.0.1:{front.server_address[1]}", server.endpoint, engine
        finally:
            front.shutdown()
            front.server_close()
    engine.shutdown()


def _post(url: str, path: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(url + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _events(raw: str) -> list[dict]:
    return [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]


def test_stop_string_streamed_and_not(http):
    url, _, _ = http
    prompt = mixed_prompts(seed=1, lengths=(9,))[0]
    base = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    _, raw = _post(url, "/v1/completions", base)
    text = json.loads(raw)["choices"][0]["text"]
    stop = next(text[i:i + 3] for i in range(4, len(text) - 3)
                if "\ufffd" not in text[i:i + 3] and text.find(text[i:i + 3]) == i)
    want = text[:text.index(stop)]
    status, raw = _post(url, "/v1/completions", {**base, "stop": [stop]})
    choice = json.loads(raw)["choices"][0]
    assert status == 200 and choice["text"] == want and choice["finish_reason"] == "stop"
    _, raw = _post(url, "/v1/completions", {**base, "stop": stop, "stream": True})
    chunks = [ch["choices"][0] for ch in _events(raw)]
    assert "".join(ch["text"] for ch in chunks) == want
    assert chunks[-1]["finish_reason"] == "stop"


def test_chat_logprobs_match_the_engine(http):
    url, endpoint, engine = http
    messages = [{"role": "user", "content": "zq"}]  # byte tokens only: ids below 256
    status, raw = _post(url, "/v1/chat/completions", {
        "messages": messages, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
        "logprobs": True, "top_logprobs": 3})
    assert status == 200, raw
    choice = json.loads(raw)["choices"][0]
    content = choice["logprobs"]["content"]
    ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                               tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    with Client(endpoint, timeout=120) as c:  # the engine belongs to the server's thread
        out = c.generate(ids, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                             logprobs=3))
    assert choice["token_ids"] == out.token_ids and len(content) == 4
    for entry, token, lps in zip(content, out.token_ids, out.logprobs):
        assert entry["logprob"] == pytest.approx(lps[token], abs=1e-6)
        assert len(entry["top_logprobs"]) == 3
        tops = [t["logprob"] for t in entry["top_logprobs"]]
        assert tops == sorted(tops, reverse=True) and tops[0] >= entry["logprob"] - 1e-6


def test_update_weights_message(http):
    import torch
    import transformers

    url, endpoint, engine = http
    model = transformers.AutoModelForCausalLM.from_pretrained(engine.cfg.model,
                                                              dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.0)
    new_dir = tempfile.mkdtemp(prefix="splash-new-weights-")
    model.save_pretrained(new_dir)
    params = SamplingParams(max_tokens=5, temperature=0.0, min_tokens=5)
    with Client(endpoint, timeout=120) as c:
        before = c.generate([9, 8, 7], params).token_ids
        with c.stream([9, 8, 7], SamplingParams(max_tokens=200, ignore_eos=True)) as s:
            next(s)
            with pytest.raises(InvalidRequestError, match="in flight"):
                c.update_weights(new_dir)
        _wait_idle(c)
        assert "version 1" in c.update_weights(new_dir)
        after = c.generate([9, 8, 7], params).token_ids
        assert c.stats()["weight_version"] == 1
        c.update_weights(engine.cfg.model)
        assert c.generate([9, 8, 7], params).token_ids == before
    assert after == hf_greedy(new_dir, [[9, 8, 7]], 5)[0] != before


def _wait_idle(c: Client) -> None:
    deadline = time.monotonic() + 60
    while c.stats()["num_running"] + c.stats()["num_waiting"] and time.monotonic() < deadline:
        time.sleep(0.05)


def test_n_choices_and_no_streamed_n(http):
    url, _, _ = http
    body = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 1.0, "seed": 4, "n": 3}
    status, raw = _post(url, "/v1/completions", body)
    choices = json.loads(raw)["choices"]
    assert status == 200 and [c["index"] for c in choices] == [0, 1, 2]
    assert json.loads(raw)["usage"]["completion_tokens"] == 9
    status, raw = _post(url, "/v1/completions", {**body, "stream": True})
    assert status == 400 and "n > 1" in raw
