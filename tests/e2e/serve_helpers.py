"""Helpers of the serving tests: a deterministic stand-in engine, an in-thread server, a
`splash serve` subprocess, and a raw DEALER socket for hand-made frames."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import zmq

from splash.errors import InvalidRequestError, WorkerDiedError
from splash.outputs import RequestOutput
from splash.sampling_params import SamplingParams
from splash.server.zmq_server import ServerConfig, ZmqServer

REPO = Path(__file__).resolve().parents[2]


def fake_tokens(prompt: list[int], n: int, vocab: int) -> list[int]:
    return [(sum(prompt) + i) % vocab for i in range(n)]


class FakeEngine:
    """EngineAPI with no model: token i = (sum(prompt) + i) % vocab, one per step; pages =
    ceil(tokens / page_size) on each of 2 ranks. test_engine_api.py holds it to the same
    conformance test as the real engine."""

    def __init__(self, vocab_size: int = 1000, max_model_len: int = 512, page_size: int = 4,
                 step_delay_s: float = 0.0, script: list[int] | None = None) -> None:
        self.vocab_size, self.max_model_len, self.page_size = vocab_size, max_model_len, page_size
        self.step_delay_s = step_delay_s
        self.script = script  # when set: output token i is script[i] for every prompt
        self.tokenizer = None
        self._reqs: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}
        self._aborted: list[str] = []
        self._layout, self._switches, self._dead, self._n = "tp", [], False, 0
        self.engine_thread: threading.Thread | None = None  # checks single-thread use

    def _check_thread(self) -> None:
        me = threading.current_thread()
        self.engine_thread = self.engine_thread or me
        assert self.engine_thread is me, "engine used from two threads"

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        self._check_thread()
        params = params or SamplingParams()
        if not prompt_token_ids:
            raise InvalidRequestError("empty prompt")
        if request_id in self._reqs:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if max(prompt_token_ids) >= self.vocab_size:
            raise InvalidRequestError(f"token id {max(prompt_token_ids)} >= vocab size")
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError("prompt + max_tokens exceeds max_model_len")
        self._n += 1
        rid = request_id or f"req-{self._n}"
        self._reqs[rid] = (list(prompt_token_ids), params, [])
        return rid

    def abort_request(self, request_id: str) -> bool:
        self._check_thread()
        if self._reqs.pop(request_id, None) is None:
            return False
        self._aborted.append(request_id)
        return True

    def step(self) -> list[RequestOutput]:
        self._check_thread()
        if self._dead:
            self._reqs.clear()
            raise WorkerDiedError("worker 1 (pid 0) exited with signal 9")
        time.sleep(self.step_delay_s)
        outs = [RequestOutput(r, [], [], finished=True, finish_reason="abort")
                for r in self._aborted]
        self._aborted = []
        for rid, (prompt, params, toks) in list(self._reqs.items()):
            tok = (self.script[len(toks) % len(self.script)] if self.script else
                   fake_tokens(prompt, len(toks) + 1, self.vocab_size)[-1])
            toks.append(tok)
            stop = tok in (params.stop_token_ids or [])
            done = stop or len(toks) >= params.max_tokens
            outs.append(RequestOutput(rid, prompt, list(toks), [tok], done,
                                      ("stop" if stop else "length") if done else None))
            if done:
                del self._reqs[rid]
        return outs

    def has_unfinished(self) -> bool:
        return bool(self._reqs or self._aborted)

    def stats(self) -> dict:
        pages = sum(-(-(len(p) + len(t)) // self.page_size) for p, _, t in self._reqs.values())
        return {"layout": self._layout, "switches": self._switches,
                "kv_capacity_tokens": {"tp": 1000, "dp": 2000, "cp": 2000, "dop": 2000},
                "kv_pages_used": [pages, pages], "kv_pages_total": 500,
                "num_waiting": 0, "num_running": len(self._reqs), "step_time_ms_ema": 1.5,
                "tokens_per_s": 100.0, "worker_pids": []}

    def switch_layout(self, name: str, after_steps: int = 0) -> None:
        self._check_thread()
        if name not in ("tp", "dp", "cp", "dop"):
            raise InvalidRequestError(f"unknown layout {name!r}")
        if after_steps < 0:
            raise InvalidRequestError("after_steps must be >= 0")
        self._switches.append({"step": 0, "from": self._layout, "to": name,
                               "kv_bytes_received": 0, "weight_bytes_received": 0,
                               "overhead_ms": 1.0})
        self._layout = name

    def update_weights(self, source: object) -> dict:
        self._check_thread()
        if self._reqs:
            raise InvalidRequestError(f"{len(self._reqs)} requests in flight: weights are "
                                      "updated between rollout rounds")
        self._weight_version = getattr(self, "_weight_version", 0) + 1
        return {"tensors": 0, "ms": 0.0, "weight_version": self._weight_version}

    def is_healthy(self) -> bool:
        return not self._dead

    def kill_worker(self) -> None:
        self._dead = True

    def shutdown(self) -> None:
        pass


@contextlib.contextmanager
def thread_server(engine: object, **config: object) -> Iterator[ZmqServer]:
    """A ZmqServer on a free loopback port, its loop in a daemon thread."""
    server = ZmqServer(engine, "tcp://127.0.0.1:*", ServerConfig(**config))  # type: ignore[arg-type]
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(server.serve_forever()), daemon=True)
    thread.start()
    server.exit_codes = result  # type: ignore[attr-defined]
    try:
        yield server
    finally:
        server.stop()
        thread.join(10)
        assert not thread.is_alive(), "server loop did not stop"


class ServeProcess:
    """`splash serve` in a subprocess (its own process group, as in a terminal); stderr goes to
    a log file the tests can read."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None,
                 start_timeout_s: float = 180.0) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")
        cmd = [sys.executable, "-m", "splash.cli", "serve", *args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, env={**os.environ, **(env or {})},
                                     start_new_session=True)
        self.zmq_addr, self.http_url = "", ""
        deadline = time.monotonic() + start_timeout_s
        want_http = "--http-port" in args
        assert self.proc.stdout is not None
        while not self.zmq_addr or (want_http and not self.http_url):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"splash serve did not start:\n{self.log()}")
            line = self.proc.stdout.readline()
            if m := re.match(r"splash serve: zmq (\S+)", line):
                self.zmq_addr = m.group(1)
            if m := re.match(r"splash serve: http (\S+)", line):
                self.http_url = m.group(1)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def stop(self, timeout_s: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


class RawPeer:
    """A bare DEALER socket: send any bytes, read replies with a timeout."""

    def __init__(self, addr: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(addr)

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def recv(self, timeout_s: float = 5.0) -> bytes | None:
        return self.sock.recv() if self.sock.poll(int(timeout_s * 1000)) else None

    def close(self) -> None:
        self.sock.close()


def fuzz_server(addr: str, examples_per_kind: int = 260) -> int:
    """Send hypothesis-made malformed frames (4 kinds, examples_per_kind each) one by one;
    each must get a protocol error reply. Returns how many frames were sent."""
    import msgspec
    from hypothesis import HealthCheck, assume, given, settings
    from hypothesis import strategies as st

    from splash.errors import ProtocolError
    from splash.server import protocol as P

    peer, sent = RawPeer(addr), [0]
    cfg = settings(max_examples=examples_per_kind, deadline=None, database=None,
                   suppress_health_check=list(HealthCheck))

    def check(frame: bytes) -> None:
        try:
            P.decode_request(frame)
            assume(False)  # valid by chance: not a malformed frame
        except ProtocolError:
            pass
        peer.send(frame)
        sent[0] += 1
        raw = peer.recv(10.0)
        assert raw is not None, f"no reply to {frame[:64]!r}"
        reply = P.decode_reply(raw)
        assert isinstance(reply, P.Error) and reply.code == "protocol", reply

    scalars = st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | \
        st.text(max_size=20) | st.binary(max_size=20)
    junk = st.recursive(scalars, lambda c: st.lists(c, max_size=4) |
                        st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=12)
    tags = st.sampled_from(["generate", "abort", "stats", "switch_layout", "health",
                            "keepalive", "final", "nope"])
    good = {"generate": {"prompt_token_ids": [1, 2]}, "abort": {"request_id": "r"},
            "switch_layout": {"layout": "tp"}, "keepalive": {"request_ids": ["r"]}}

    @cfg
    @given(st.binary(max_size=256))
    def random_bytes(b: bytes) -> None:
        check(b)

    @cfg
    @given(junk)
    def random_msgpack(obj: object) -> None:
        check(msgspec.msgpack.encode(obj))

    @cfg
    @given(tags, st.integers(-5, 2**32).filter(lambda v: v != P.PROTOCOL_VERSION))
    def wrong_version(tag: str, v: int) -> None:
        check(msgspec.msgpack.encode({"type": tag, "v": v, "id": "x", **good.get(tag, {})}))

    @cfg
    @given(tags, st.dictionaries(st.sampled_from(["v", "id", "token", "prompt_token_ids",
                                                  "params", "stream", "request_id", "layout",
                                                  "request_ids", "extra"]), junk, max_size=6))
    def wrong_fields(tag: str, fields: dict) -> None:
        check(msgspec.msgpack.encode({"type": tag, **fields}))

    try:
        for fn in (random_bytes, random_msgpack, wrong_version, wrong_fields):
            fn()
    finally:
        peer.close()
    return sent[0]
