"""Client library of `splash serve`: ``Client`` (blocking) and ``AsyncClient``
(asyncio) with the same methods.

    with Client("tcp://127.0.0.1:5557") as c:
        out = c.generate([1, 2, 3], SamplingParams(max_tokens=8))   # -> RequestOutput
        for delta in c.stream([1, 2, 3], SamplingParams(max_tokens=8)):
            ...                                                     # list[int] per step

Every call has a timeout: ``timeout`` is the longest the server may stay silent about a call
before RequestTimeoutError. While a generation runs the client renews its lease with a
``keepalive`` about once a second and the server answers, so long generations never time out
on a live server. Closing a stream early (``close()``, leaving ``with``, dropping it) sends
``abort``; a client that vanishes stops renewing and the server aborts its requests after its
``client_timeout_s``. A blocking stream's consumer must therefore pull at least that often.
Server errors are raised as SplashError subclasses carrying the server's message.

    python -m splash.client health tcp://127.0.0.1:5557   # exit 0 iff the server is healthy
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from typing import Any

import zmq
import zmq.asyncio

from splash.client_async import AsyncClient, AsyncTokenStream
from splash.client_common import _Base, _StreamState
from splash.errors import ProtocolError, SplashError
from splash.outputs import RequestOutput
from splash.sampling_params import SamplingParams
from splash.server import protocol as P


class TokenStream(_StreamState):
    """Iterator of token-id deltas of one request; ``output`` once exhausted. ``close()``
    (also on leaving ``with`` or garbage collection) aborts the request if still running."""

    def __init__(self, client: Client, request_id: str) -> None:
        super().__init__(request_id)
        self._client = client

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> list[int]:
        while not self.done:
            try:
                delta = self._take(self._client._wait(self.request_id))
            except BaseException:
                self.close()
                raise
            if self.done:
                self._client._forget(self.request_id)
            if delta:
                return delta
        raise StopIteration

    def close(self) -> None:
        if not self.done:
            self.done = True
            self._client._forget(self.request_id)
            self._client._abort_quietly(self.request_id)

    def __enter__(self) -> TokenStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class Client(_Base):
    """Blocking client; not thread-safe (one per thread, like the ZeroMQ socket under it)."""

    def __init__(self, addr: str, timeout: float = 30.0, token: str | None = None,
                 keepalive_s: float = 1.0, context: zmq.Context | None = None) -> None:
        super().__init__(addr, timeout, token, keepalive_s, context or zmq.Context.instance())
        self._inbox: dict[str, collections.deque] = {}
        self._next_keepalive = 0.0

    def generate(self, prompt_ids: list[int], params: SamplingParams | None = None
                 ) -> RequestOutput:
        msg = self._generate_msg(prompt_ids, params, stream=False)
        reply = self._call(msg, renew=True)
        if not isinstance(reply, P.Final):
            raise ProtocolError(f"expected a final reply, got {type(reply).__name__}")
        return reply.output

    def stream(self, prompt_ids: list[int], params: SamplingParams | None = None
               ) -> TokenStream:
        msg = self._generate_msg(prompt_ids, params, stream=True)
        self._register(msg.id, renew=True)
        self._send(msg)
        return TokenStream(self, msg.id)

    def abort(self, request_id: str) -> None:
        self._call(self._msg(P.Abort, request_id=request_id))

    def stats(self) -> dict[str, Any]:
        return self._call(self._msg(P.Stats)).stats  # type: ignore[attr-defined]

    def switch_layout(self, layout: str) -> None:
        """Switch live at the next step; under auto it stays pinned until "auto" releases it."""
        self._call(self._msg(P.SwitchLayout, layout=layout))

    def update_weights(self, path: str) -> str:
        """Load a checkpoint directory (on the server's host) in place, between rounds: the
        server refuses while requests are in flight."""
        reply = self._call(self._msg(P.UpdateWeights, path=str(path)))
        return reply.detail  # type: ignore[attr-defined]

    def health(self) -> bool:
        return bool(self._call(self._msg(P.Health)).healthy)  # type: ignore[attr-defined]

    def close(self) -> None:
        if not self._closed:
            for rid in list(self._open):
                self._abort_quietly(rid)
            self._closed = True
            self._sock.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _register(self, cid: str, renew: bool = False) -> None:
        self._inbox[cid] = collections.deque()
        if renew:
            self._open.add(cid)

    def _forget(self, cid: str) -> None:
        self._inbox.pop(cid, None)
        self._open.discard(cid)

    def _send(self, msg: P.Request) -> None:
        try:
            self._sock.send(P.encode(msg))
        except zmq.Again:
            self._forget(msg.id)
            raise self._timeout_error() from None

    def _call(self, msg: P.Request, renew: bool = False) -> P.Reply:
        self._register(msg.id, renew)
        try:
            self._send(msg)
            return self._wait(msg.id)
        finally:
            self._forget(msg.id)

    def _wait(self, cid: str) -> P.Reply:
        inbox = self._inbox[cid]
        deadline = time.monotonic() + self.timeout
        while True:
            while inbox:
                reply = self._unwrap(inbox.popleft())
                if reply is not None:
                    return reply
                deadline = time.monotonic() + self.timeout
            now = time.monotonic()
            if now >= deadline:
                raise self._timeout_error()
            if self._open and now >= self._next_keepalive:
                self._next_keepalive = now + self.keepalive_s
                self._send(self._msg(P.KeepAlive, request_ids=sorted(self._open)))
            wait_ms = 1 + int(1000 * min(deadline - now, self.keepalive_s))
            while self._sock.poll(wait_ms):
                self._route(self._sock.recv(), self._put)
                wait_ms = 0

    def _put(self, cid: str, item: Any) -> None:
        inbox = self._inbox.get(cid)
        if inbox is not None:
            inbox.append(item)


# ----------------------------------------------------------------------------- asyncio
# ----------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    """``python -m splash.client health ADDR``: exit 0 iff the server answers healthy."""
    parser = argparse.ArgumentParser(prog="python -m splash.client")
    parser.add_argument("command", choices=["health"])
    parser.add_argument("addr", help="e.g. tcp://127.0.0.1:5557")
    parser.add_argument("--timeout", type=float, default=5.0)
    args = parser.parse_args(argv)
    try:
        with Client(args.addr, timeout=args.timeout) as client:
            healthy = client.health()
    except SplashError as e:
        print(f"unhealthy: {e}", file=sys.stderr)
        return 1
    print("healthy" if healthy else "unhealthy")
    return 0 if healthy else 1


__all__ = ["AsyncClient", "AsyncTokenStream", "Client", "TokenStream", "main"]

if __name__ == "__main__":
    sys.exit(main())
