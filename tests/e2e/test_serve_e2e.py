"""`splash serve` end to end with the real engine: tiny DeepSeek-V3 checkpoint, 2 CPU workers,
the server in a subprocess, clients over loopback.

One server process carries most checks (one engine start-up instead of five): 32 concurrent
requests token-identical to offline LLM.generate (their prefill over several steps), fuzzed
frames (1,000+ against the same ZmqServer in test_serve_fake), an unknown layout answered as
an invalid request, abort mid-stream, SSE and /metrics. Worker death gets its own server,
since it ends the process.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from serve_helpers import REPO, RawPeer, ServeProcess, fuzz_server

from splash.client import AsyncClient, Client
from splash.errors import InvalidRequestError, RequestTimeoutError, WorkerDiedError
from splash.outputs import RequestOutput
from splash.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
SERVE_ARGS = ["--tp", "2", "--backend", "cpu", "--port", "0"]
# requests in flight at once; each costs ~0.2 s per engine step on CPU. 32: their 67 prompt
# tokens pass a 32-token step budget (the server's and the offline engine's), so the prefill
# takes more than one step, as 128 did over the default 256 at four times the steps' cost
NUM_CONCURRENT = 32
STEP_BUDGET = 32
# CPU kernels run under the Triton interpreter; a 200-row step takes tens of seconds there
CPU_ENV = {"TRITON_INTERPRET": "1", "SPLASH_WORKER_TIMEOUT_S": "600"}
SLOW_STEP_TIMEOUT_S = 600.0  # client timeout while the engine runs those big steps


@pytest.fixture(scope="module", autouse=True)
def _cpu_env() -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in CPU_ENV}
    os.environ.update(CPU_ENV)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from splash.model.presets import make_model

    out = tmp_path_factory.mktemp("serve") / "tiny-v3"
    make_model(out, "deepseek-v3", layers=1, seed=0, scale="tiny")
    return str(out)


def _prompts(n: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randint(1, 3))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(1, 3), temperature=0.0) for _ in range(n)]
    return prompts, params


def test_serve_matches_offline_and_survives_abuse(model_dir: str, tmp_path: Path) -> None:
    from splash import LLM

    with LLM(model=model_dir, tp_size=2, backend="cpu",
             max_num_batched_tokens=STEP_BUDGET) as llm:
        prompts, params = _prompts(NUM_CONCURRENT, llm.engine.vocab_size)
        assert sum(map(len, prompts)) > STEP_BUDGET  # the prefill takes several steps
        reference = [o.token_ids for o in llm.generate(prompts, params)]
        with_logprobs = llm.generate([prompts[2]], SamplingParams(
            max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2, n=2))[0]
    server = ServeProcess([*SERVE_ARGS, "--model", model_dir, "--http-port", "0",
                           "--max-num-batched-tokens", str(STEP_BUDGET)],
                          tmp_path / "serve.log")
    try:
        addr = server.zmq_addr
        # NUM_CONCURRENT requests at once, half streamed, through one AsyncClient
        got = asyncio.run(_concurrent(addr, prompts, params))
        mismatches = [i for i, (g, r) in enumerate(zip(got, reference)) if g != r]
        assert not mismatches, f"{len(mismatches)} differ, first {mismatches[:5]}"

        # malformed frames: each answered with an error; then correct answers again (the
        # frames meet the ZmqServer that test_serve_fake fuzzes with 1,000+)
        assert fuzz_server(addr, examples_per_kind=50) >= 190
        peer = RawPeer(addr)
        peer.send(b"\x00" * (5 << 20))  # over the 4 MiB limit: error reply
        assert b"exceeds" in (peer.recv(10.0) or b"")
        peer.send(b"\x00" * (9 << 20))  # over the hard limit: zmq drops it, the server logs
        peer.close()
        with Client(addr, timeout=30) as c:
            assert c.generate(prompts[0], params[0]).token_ids == reference[0]
            _wait_for(lambda: "peer disconnected" in server.log())

            # an unknown layout is the client's error, not the server's (no traceback logged)
            with pytest.raises(InvalidRequestError, match="unknown layout 'zigzag'"):
                c.switch_layout("zigzag")
            assert "SwitchLayout failed" not in server.log()

            # abort mid-stream: pages back to baseline
            base = c.stats()["kv_pages_used"]
            s = c.stream(prompts[1], SamplingParams(max_tokens=200, ignore_eos=True))
            assert next(s)
            s.close()
            _wait_for(lambda: c.stats()["kv_pages_used"] == base)
            assert c.health()

        _check_http(server.http_url, prompts[2], params[2], reference[2])
        _check_http_logprobs(server.http_url, prompts[2], with_logprobs)
    finally:
        assert server.stop() == 0, server.log()


async def _concurrent(addr: str, prompts: list[list[int]], params: list[SamplingParams]
                      ) -> list[list[int]]:
    async with AsyncClient(addr, timeout=SLOW_STEP_TIMEOUT_S) as c:
        async def one(i: int) -> list[int]:
            if i % 2:
                return (await c.generate(prompts[i], params[i])).token_ids
            stream = await c.stream(prompts[i], params[i])
            tokens = [t async for delta in stream for t in delta]
            assert stream.output is not None and stream.output.token_ids == tokens
            return tokens

        return await asyncio.gather(*(one(i) for i in range(len(prompts))))


def _check_http(url: str, prompt: list[int], params: SamplingParams, expected: list[int]) -> None:
    body = {"prompt": prompt, "max_tokens": params.max_tokens, "temperature": 0,
            "stream": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.headers["Content-Type"] == "text/event-stream"
        events = [e[6:] for e in resp.read().decode().split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) >= 2
    chunks = [json.loads(e) for e in events[:-1]]
    assert sum((ch["choices"][0]["token_ids"] for ch in chunks), []) == expected
    metrics = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    _assert_prometheus(metrics)
    assert "splash_kv_pages_used{rank=\"1\"}" in metrics and "splash_layout_info{" in metrics


def _check_http_logprobs(url: str, prompt: list[int], expected: RequestOutput) -> None:
    """n samples and logprobs through the OpenAI API, as the offline engine gives them."""
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "logprobs": 2, "n": 2}
    for stream in (False, True):
        body["stream"], body["n"] = stream, 1 if stream else 2
        req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            raw = resp.read().decode()
        if stream:
            chunks = [json.loads(e[6:]) for e in raw.split("\n\n")
                      if e.startswith("data: {")]
            lps = [ch["choices"][0]["logprobs"] for ch in chunks if ch["choices"][0]["token_ids"]]
            got = [sum((lp["token_logprobs"] for lp in lps), [])]
        else:
            choices = json.loads(raw)["choices"]
            assert [ch["index"] for ch in choices] == [0, 1]
            for ch, sample in zip(choices, expected.outputs):
                assert ch["token_ids"] == sample.token_ids
                assert all(len(top) == 2 for top in ch["logprobs"]["top_logprobs"])
            got = [ch["logprobs"]["token_logprobs"] for ch in choices]
        want = [[d[t] for t, d in zip(s.token_ids, s.logprobs or [])] for s in expected.outputs]
        for g, w in zip(got, want):
            assert g == pytest.approx(w, abs=1e-5)
    metrics = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    assert "splash_prefix_cache_hit_tokens_total" in metrics
    assert "splash_prefix_cache_queried_tokens_total" in metrics


def _assert_prometheus(text: str) -> None:
    """Line-by-line check of the text exposition format (HELP/TYPE, then samples)."""
    import re

    sample = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="([^"\\]|\\.)*"'
                        r'(,[a-zA-Z_][a-zA-Z0-9_]*="([^"\\]|\\.)*")*)?\})? '
                        r'(-?[0-9.eE+-]+|NaN|[+-]Inf)$')
    typed: set[str] = set()
    for line in text.strip().splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            assert kind in ("counter", "gauge") and name not in typed
            typed.add(name)
        elif not line.startswith("# HELP "):
            assert sample.match(line), line
            assert line.split("{")[0].split(" ")[0] in typed, line


def test_worker_death_fails_clients_fast(model_dir: str, tmp_path: Path) -> None:
    server = ServeProcess([*SERVE_ARGS, "--model", model_dir], tmp_path / "serve.log")
    try:
        with Client(server.zmq_addr, timeout=30) as c:
            pids = c.stats()["worker_pids"]
            streams = [c.stream([i + 2, 7], SamplingParams(max_tokens=400, ignore_eos=True))
                       for i in range(4)]
            assert next(streams[0])
            t0 = time.monotonic()
            os.kill(pids[1], signal.SIGKILL)
            for s in streams:
                with pytest.raises(WorkerDiedError, match="worker"):
                    list(s)
            assert time.monotonic() - t0 < 10
        with Client(server.zmq_addr, timeout=2) as c:
            try:
                assert c.health() is False
            except RequestTimeoutError:
                pass  # already exited
        assert server.proc.wait(30) == 3
    finally:
        server.stop()


def test_non_loopback_bind_without_token_refuses(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SPLASH_TOKEN"}
    proc = subprocess.run([sys.executable, "-m", "splash.cli", "serve", "--model",
                           str(tmp_path / "none"), "--host", "0.0.0.0", "--port", "0"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "refusing to bind 0.0.0.0" in proc.stderr and "--token" in proc.stderr


def _wait_for(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)
