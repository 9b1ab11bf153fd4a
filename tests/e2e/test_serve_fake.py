"""The serving surface against a stand-in engine (fast): protocol, client, leases, faults,
HTTP. The same paths against the real engine are in test_serve_e2e.py."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import msgspec
import pytest
from serve_helpers import FakeEngine, RawPeer, fake_tokens, thread_server
from tiny_tokenizer import load_tokenizer

import splash.core.pause as pause_module
from splash.client import AsyncClient, Client
from splash.errors import (
    InvalidRequestError,
    NotFoundError,
    ProtocolError,
    RequestTimeoutError,
    WorkerDiedError,
)
from splash.sampling_params import SamplingParams
from splash.server import protocol as P
from splash.server import zmq_server

pytestmark = pytest.mark.timeout(60)
GREEDY = SamplingParams(max_tokens=5, temperature=0.0)


def test_generate_stream_and_control() -> None:
    with thread_server(FakeEngine()) as server, Client(server.endpoint, timeout=5) as c:
        out = c.generate([1, 2, 3], GREEDY)
        assert out.token_ids == fake_tokens([1, 2, 3], 5, 1000)
        assert out.finished and out.finish_reason == "length"
        with c.stream([4, 5], GREEDY) as s:
            deltas = list(s)
        assert deltas == [[t] for t in fake_tokens([4, 5], 5, 1000)]
        assert s.output is not None and s.output.token_ids == fake_tokens([4, 5], 5, 1000)
        assert c.health() is True
        c.switch_layout("dop")
        stats = c.stats()
        assert stats["layout"] == "dop" and stats["server"]["requests_finished"] == 2
        with pytest.raises(InvalidRequestError, match="unknown layout"):
            c.switch_layout("zz")
        with pytest.raises(InvalidRequestError, match="empty prompt"):
            c.generate([], GREEDY)
        with pytest.raises(InvalidRequestError, match="max_tokens"):
            c.generate([1], {"max_tokens": 0})  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match="token ids, not text"):
            c.generate("hello", GREEDY)  # type: ignore[arg-type]
        assert c.health() is True
        with pytest.raises(NotFoundError):
            c.abort("nope")


def test_async_client_many_concurrent() -> None:
    async def run(addr: str) -> None:
        async with AsyncClient(addr, timeout=10) as c:
            prompts = [[i, i + 1] for i in range(100)]
            outs = await asyncio.gather(*(c.generate(p, GREEDY) for p in prompts))
            for p, o in zip(prompts, outs):
                assert o.token_ids == fake_tokens(p, 5, 1000)
            s = await c.stream([7], GREEDY)
            got = [d async for d in s]
            assert sum(got, []) == fake_tokens([7], 5, 1000)
            assert await c.health()

    with thread_server(FakeEngine()) as server:
        asyncio.run(run(server.endpoint))


def test_stream_close_aborts_and_frees_pages() -> None:
    engine = FakeEngine(step_delay_s=0.01)
    with thread_server(engine) as server, Client(server.endpoint, timeout=5) as c:
        base = c.stats()["kv_pages_used"]
        s = c.stream([1, 2, 3], SamplingParams(max_tokens=400, ignore_eos=True))
        next(s)
        assert c.stats()["kv_pages_used"] != base
        s.close()
        _wait_for(lambda: c.stats()["kv_pages_used"] == base)
        assert c.stats()["server"]["aborts"] == 1


def test_silent_client_lease_expires() -> None:
    engine = FakeEngine(step_delay_s=0.01)
    with thread_server(engine, client_timeout_s=0.5) as server:
        peer = RawPeer(server.endpoint)  # sends generate, then never renews its lease
        msg = P.Generate(v=1, id="gone-1", prompt_token_ids=[1], stream=True,
                         params={"max_tokens": 400, "ignore_eos": True})
        peer.send(P.encode(msg))
        assert isinstance(P.decode_reply(peer.recv()), P.Delta)
        with Client(server.endpoint, timeout=5) as c:
            _wait_for(lambda: c.stats()["server"]["lease_expired"] == 1)
            assert c.stats()["kv_pages_used"] == [0, 0]
        peer.close()


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


def test_a_paused_server_keeps_its_leases(monkeypatch) -> None:
    # the server process stopped for 30 s (Ctrl-Z, then fg): its clients' renewals wait
    # unread on the socket, so the pause must not count as their silence; a client that
    # then stays silent still loses its lease
    clock = _Clock()
    monkeypatch.setattr(zmq_server, "time", clock)
    monkeypatch.setattr(pause_module, "time", clock)
    engine = FakeEngine()
    server = zmq_server.ZmqServer(engine, "tcp://127.0.0.1:*",  # type: ignore[arg-type]
                                  zmq_server.ServerConfig(client_timeout_s=10.0))
    try:
        rid = engine.add_request([1, 2], SamplingParams(max_tokens=4))
        server._leases[rid] = zmq_server._Lease(b"peer", True, clock.now)
        clock.now = 1.0
        server._expire_leases()
        clock.now = 31.0  # the loop's next turn, after the pause
        server._expire_leases()
        assert rid in server._leases and server._counters.lease_expired == 0
        for _ in range(22):  # 11 s of the loop's turns, renewed by nobody
            clock.now += 0.5
            server._expire_leases()
        assert rid not in server._leases and server._counters.lease_expired == 1
    finally:
        server._close()


def test_bad_frames_get_error_replies() -> None:
    with thread_server(FakeEngine(), max_frame_bytes=4096) as server:
        peer = RawPeer(server.endpoint)
        cases = [b"", b"\xc1", b"\x93\x01\x02\x03", msgspec.msgpack.encode({"type": "health"}),
                 msgspec.msgpack.encode({"type": "health", "v": 9, "id": "x"}),
                 msgspec.msgpack.encode({"type": "generate", "v": 1, "id": "g",
                                         "prompt_token_ids": [-1]}),
                 msgspec.msgpack.encode({"type": "stats", "v": 1, "id": "s", "extra": 1}),
                 b"\x00" * 5000]
        for frame in cases:
            peer.send(frame)
            reply = P.decode_reply(peer.recv())
            assert isinstance(reply, P.Error) and reply.code == "protocol", frame[:20]
        peer.send(b"a", b"b")
        assert P.decode_reply(peer.recv()).code == "protocol"
        peer.send(b"\x00" * 10_000)  # over the hard limit: zmq drops the connection
        assert peer.recv(0.5) is None
        with Client(server.endpoint, timeout=5) as c:
            assert c.generate([3], GREEDY).token_ids == fake_tokens([3], 5, 1000)
            _wait_for(lambda: c.stats()["server"]["dropped_connections"] >= 1)
        peer.close()


def test_token_required_and_checked() -> None:
    with thread_server(FakeEngine(), token="s3cret") as server:
        with Client(server.endpoint, timeout=5, token="wrong") as c:
            assert c.health()  # health is exempt
            with pytest.raises(ProtocolError, match="token"):
                c.stats()
        with Client(server.endpoint, timeout=5, token="s3cret") as c:
            assert c.generate([1], GREEDY).token_ids == fake_tokens([1], 5, 1000)


def test_worker_death_fails_waiters_fast() -> None:
    engine = FakeEngine(step_delay_s=0.01)
    with thread_server(engine, fail_grace_s=2.0) as server:
        with Client(server.endpoint, timeout=5) as c:
            s = c.stream([1], SamplingParams(max_tokens=400, ignore_eos=True))
            next(s)
            t0 = time.monotonic()
            engine.kill_worker()
            with pytest.raises(WorkerDiedError, match="worker"):
                list(s)
            assert time.monotonic() - t0 < 2
            assert c.health() is False
        _wait_for(lambda: server.exit_codes == [3])  # type: ignore[attr-defined]


def test_timeout_when_nobody_answers() -> None:
    with Client("tcp://127.0.0.1:9", timeout=0.3) as c:
        t0 = time.monotonic()
        with pytest.raises(RequestTimeoutError):
            c.health()
        assert time.monotonic() - t0 < 2


def test_http_endpoints() -> None:
    from splash.server.http import OpenAIHTTPServer

    with thread_server(FakeEngine()) as server:
        http = OpenAIHTTPServer("127.0.0.1", 0, server.inproc_endpoint, server.context,
                                None, None, "fake")
        http.start()
        url = f"http://127.0.0.1:{http.server_address[1]}"
        try:
            body = {"prompt": [1, 2], "max_tokens": 4, "temperature": 0}
            got = _post(url + "/v1/completions", body)
            assert got["choices"][0]["token_ids"] == fake_tokens([1, 2], 4, 1000)
            events = _post_sse(url + "/v1/completions", {**body, "stream": True})
            assert sum((e["choices"][0]["token_ids"] for e in events), []) == \
                fake_tokens([1, 2], 4, 1000)
            assert events[-1]["choices"][0]["finish_reason"] == "length"
            with pytest.raises(urllib.error.HTTPError) as err:
                _post(url + "/v1/chat/completions", {"messages": [{"role": "user",
                                                                   "content": "hi"}]})
            assert err.value.code == 400 and b"chat template" in err.value.read()
            with pytest.raises(urllib.error.HTTPError) as err:
                _post(url + "/v1/completions", {"prompt": "text needs a tokenizer"})
            assert err.value.code == 400 and b"splash-serve[tokenizer]" in err.value.read()
            assert json.loads(urllib.request.urlopen(url + "/health", timeout=5).read()) == \
                {"status": "ok"}
            text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
            assert 'splash_layout_info{layout="tp"} 1.0' in text
        finally:
            http.shutdown()
            http.server_close()


def _post(url: str, body: dict, headers: dict | None = None) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **(headers or {})})
    return json.loads(urllib.request.urlopen(req, timeout=10).read())


def _post_sse(url: str, body: dict, headers: dict | None = None) -> list[dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.headers["Content-Type"] == "text/event-stream"
        chunks = [ln[6:] for ln in resp.read().decode().split("\n\n") if ln.startswith("data: ")]
    assert chunks[-1] == "[DONE]"
    return [json.loads(c) for c in chunks[:-1]]


def _wait_for(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_fuzzed_frames_never_break_the_server() -> None:
    from serve_helpers import fuzz_server

    with thread_server(FakeEngine()) as server:
        assert fuzz_server(server.endpoint, examples_per_kind=260) >= 1000
        with Client(server.endpoint, timeout=5) as c:
            assert c.generate([9], GREEDY).token_ids == fake_tokens([9], 5, 1000)


def _http(server, token: str | None = None, tokenizer=None):
    from splash.server.http import OpenAIHTTPServer

    http = OpenAIHTTPServer("127.0.0.1", 0, server.inproc_endpoint, server.context, token,
                            tokenizer, "fake")
    http.start()
    return http, f"http://127.0.0.1:{http.server_address[1]}"


def test_http_text_and_chat_with_a_real_tokenizer() -> None:
    """A real HF tokenizer with a real chat template (transformers 5 returns a BatchEncoding
    from apply_chat_template)."""
    tok = load_tokenizer()
    messages = [{"role": "user", "content": "hello world"}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    chat_ids = tok.encode(rendered, add_special_tokens=False)
    with thread_server(FakeEngine(vocab_size=len(tok))) as server:
        http, url = _http(server, "tkn", tok)
        try:
            with pytest.raises(urllib.error.HTTPError) as err:
                _post(url + "/v1/completions", {"prompt": "hi"})
            assert err.value.code == 401
            auth = {"Authorization": "Bearer tkn"}
            got = _post(url + "/v1/completions", {"prompt": "the fox", "max_tokens": 3}, auth)
            ids = fake_tokens(tok.encode("the fox"), 3, len(tok))
            assert got["choices"][0]["token_ids"] == ids
            assert got["choices"][0]["text"] == tok.decode(ids, skip_special_tokens=True)
            chat = {"messages": messages, "max_tokens": 3}
            got = _post(url + "/v1/chat/completions", chat, auth)
            ids = fake_tokens(chat_ids, 3, len(tok))
            assert got["usage"]["prompt_tokens"] == len(chat_ids)
            assert got["choices"][0]["token_ids"] == ids
            assert got["choices"][0]["message"]["content"] == tok.decode(ids,
                                                                         skip_special_tokens=True)
            events = _post_sse(url + "/v1/chat/completions", {**chat, "stream": True}, auth)
            assert "".join(e["choices"][0]["delta"]["content"] for e in events) == \
                tok.decode(ids, skip_special_tokens=True)
        finally:
            http.shutdown()
            http.server_close()


@pytest.mark.parametrize("chat", [False, True])
def test_http_stream_keeps_multibyte_characters_whole(chat: bool) -> None:
    """Byte-level tokens of '中文' streamed one per step arrive as whole characters."""
    tok = load_tokenizer()
    text = "中文 hello 中文"
    script = tok.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tok.decode(script[:i]) for i in range(1, len(script)))  # splits
    with thread_server(FakeEngine(vocab_size=len(tok), script=script)) as server:
        http, url = _http(server, tokenizer=tok)
        try:
            body = {"max_tokens": len(script), "stream": True}
            if chat:
                body["messages"] = [{"role": "user", "content": "hi"}]
            else:
                body["prompt"] = "hi"
            events = _post_sse(url + ("/v1/chat/completions" if chat else "/v1/completions"),
                               body)
            pieces = [e["choices"][0]["delta"]["content"] if chat else e["choices"][0]["text"]
                      for e in events]
            assert "".join(pieces) == text
            assert not any("\ufffd" in p for p in pieces), pieces
            assert sum((e["choices"][0]["token_ids"] for e in events), []) == script
        finally:
            http.shutdown()
            http.server_close()


@pytest.mark.parametrize("extra", [{"echo": True}, {"presence_penalty": 0.5},
                                   {"logit_bias": {"5": 1}}])
def test_http_rejects_unsupported_openai_params(extra: dict) -> None:
    """Parameters the engine does not implement are a 400 naming them, never silently
    ignored; their neutral values (null, false, 0) are accepted."""
    tok = load_tokenizer()
    with thread_server(FakeEngine(vocab_size=len(tok))) as server:
        http, url = _http(server, tokenizer=tok)
        try:
            for path, body in (("/v1/completions", {"prompt": [1, 2]}),
                               ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                       "content": "hi"}]})):
                with pytest.raises(urllib.error.HTTPError) as err:
                    _post(url + path, {**body, "max_tokens": 2, **extra})
                assert err.value.code == 400
                assert next(iter(extra)) in json.loads(err.value.read())["error"]["message"]
            neutral = {"stop": None, "logprobs": None, "echo": False, "presence_penalty": 0}
            got = _post(url + "/v1/completions", {"prompt": [1, 2], "max_tokens": 2, **neutral})
            assert got["choices"][0]["token_ids"] == fake_tokens([1, 2], 2, len(tok))
        finally:
            http.shutdown()
            http.server_close()
