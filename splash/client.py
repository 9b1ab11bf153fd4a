"""Client library of `splash serve` (CONTRACT): ``Client`` (blocking) and ``AsyncClient``
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
import asyncio
import collections
import sys
import time
import uuid
from typing import Any

import zmq
import zmq.asyncio

from splash import envs
from splash.errors import ConfigError, ProtocolError, RequestTimeoutError, SplashError
from splash.outputs import RequestOutput
from splash.sampling_params import SamplingParams
from splash.server import protocol as P

_ALIVE = object()  # inbox marker: the server confirmed it still runs the request


class _Base:
    def __init__(self, addr: str, timeout: float, token: str | None, keepalive_s: float,
                 context: zmq.Context) -> None:
        if timeout <= 0 or keepalive_s <= 0:
            raise ValueError("timeout and keepalive_s must be > 0")
        self.addr, self.timeout, self.keepalive_s = addr, timeout, keepalive_s
        self._token = envs.get("SPLASH_TOKEN") if token is None else token
        self._sock = context.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 500)  # lets a closing stream's abort out
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
        try:
            self._sock.connect(addr)
        except zmq.ZMQError as e:
            self._sock.close(linger=0)
            raise ConfigError(f"cannot connect to {addr!r}: {e}") from None
        self._open: set[str] = set()  # generate ids whose lease this client renews
        self._closed = False

    def _msg(self, cls: type[P.Request], **fields: Any) -> P.Request:
        fields.setdefault("id", uuid.uuid4().hex)
        return cls(v=P.PROTOCOL_VERSION, token=self._token, **fields)

    def _generate_msg(self, prompt_ids: list[int], params: SamplingParams | None,
                      stream: bool) -> P.Request:
        return self._msg(P.Generate, prompt_token_ids=list(prompt_ids), stream=stream,
                         params=P.params_to_wire(params))

    def _route(self, frame: bytes, put: Any) -> None:
        """Hand one reply frame to the waiter(s) it concerns: put(correlation_id, item)."""
        try:
            reply = P.decode_reply(frame)
        except ProtocolError:
            return  # not from a server speaking our protocol; nobody to give it to
        if isinstance(reply, P.Alive):
            for rid in reply.alive:
                put(rid, _ALIVE)
            for rid in reply.gone:
                msg = (f"request {rid} is unknown to the server: aborted (e.g. its lease "
                       "expired), or the server restarted")
                put(rid, P.Error(id=rid, code="not_found", message=msg))
        else:
            put(reply.id, reply)

    def _abort_quietly(self, request_id: str) -> None:
        """Fire-and-forget abort (stream closed early); the Ok/not_found reply is dropped."""
        if not self._closed:
            try:  # a plain (non-asyncio) view of the socket, so no Future is left behind
                raw: zmq.Socket = zmq.Socket.shadow(self._sock.underlying)
                raw.send(P.encode(self._msg(P.Abort, request_id=request_id)), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def _timeout_error(self) -> RequestTimeoutError:
        return RequestTimeoutError(f"no answer from {self.addr} within {self.timeout} s")

    @staticmethod
    def _unwrap(item: Any) -> P.Reply | None:
        """None for a lease confirmation; raises for an error reply."""
        if item is _ALIVE:
            return None
        if isinstance(item, P.Error):
            raise P.error_from_reply(item)
        return item


class _StreamState:
    """Shared by both stream classes: turns delta/final replies into token lists."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.output: RequestOutput | None = None  # set when the request finished
        self.done = False
        self._received = 0

    def _take(self, reply: P.Reply) -> list[int]:
        if isinstance(reply, P.Delta):
            self._received += len(reply.token_ids)
            return list(reply.token_ids)
        if isinstance(reply, P.Final):
            self.output, self.done = reply.output, True
            tail = reply.output.token_ids[self._received:]  # final carries what deltas did not
            self._received = len(reply.output.token_ids)
            return list(tail)
        raise ProtocolError(f"unexpected {type(reply).__name__} reply in a stream")


# ----------------------------------------------------------------------------- blocking
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
        self._call(self._msg(P.SwitchLayout, layout=layout))

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
class AsyncTokenStream(_StreamState):
    """Async iterator of token-id deltas; ``await aclose()`` (or ``async with``) aborts."""

    def __init__(self, client: AsyncClient, request_id: str) -> None:
        super().__init__(request_id)
        self._client = client

    def __aiter__(self) -> AsyncTokenStream:
        return self

    async def __anext__(self) -> list[int]:
        while not self.done:
            try:
                delta = self._take(await self._client._wait(self.request_id))
            except BaseException:
                await self.aclose()
                raise
            if self.done:
                self._client._forget(self.request_id)
            if delta:
                return delta
        raise StopAsyncIteration

    async def aclose(self) -> None:
        if not self.done:
            self.done = True
            self._client._forget(self.request_id)
            self._client._abort_quietly(self.request_id)

    async def __aenter__(self) -> AsyncTokenStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        if not self.done:  # not closed: stop renewing its lease and try to abort now
            self.done = True
            try:
                self._client._forget(self.request_id)
                self._client._abort_quietly(self.request_id)
            except Exception:
                pass


class AsyncClient(_Base):
    """asyncio client: one socket shared by any number of concurrent calls of one loop."""

    def __init__(self, addr: str, timeout: float = 30.0, token: str | None = None,
                 keepalive_s: float = 1.0, context: zmq.asyncio.Context | None = None) -> None:
        super().__init__(addr, timeout, token, keepalive_s,
                         context or zmq.asyncio.Context.instance())
        self._queues: dict[str, asyncio.Queue] = {}
        self._tasks: list[asyncio.Task] = []

    async def generate(self, prompt_ids: list[int], params: SamplingParams | None = None
                       ) -> RequestOutput:
        reply = await self._call(self._generate_msg(prompt_ids, params, False), renew=True)
        if not isinstance(reply, P.Final):
            raise ProtocolError(f"expected a final reply, got {type(reply).__name__}")
        return reply.output

    async def stream(self, prompt_ids: list[int], params: SamplingParams | None = None
                     ) -> AsyncTokenStream:
        msg = self._generate_msg(prompt_ids, params, True)
        self._register(msg.id, renew=True)
        await self._send(msg)
        return AsyncTokenStream(self, msg.id)

    async def abort(self, request_id: str) -> None:
        await self._call(self._msg(P.Abort, request_id=request_id))

    async def stats(self) -> dict[str, Any]:
        return (await self._call(self._msg(P.Stats))).stats  # type: ignore[attr-defined]

    async def switch_layout(self, layout: str) -> None:
        await self._call(self._msg(P.SwitchLayout, layout=layout))

    async def health(self) -> bool:
        return bool((await self._call(self._msg(P.Health))).healthy)  # type: ignore[attr-defined]

    async def close(self) -> None:
        if self._closed:
            return
        for rid in list(self._open):
            self._abort_quietly(rid)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._closed = True
        self._sock.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ internals
    def _register(self, cid: str, renew: bool = False) -> None:
        if not self._tasks:  # started on first use, inside the caller's event loop
            self._tasks = [asyncio.create_task(self._reader()), asyncio.create_task(self._pinger())]
        self._queues[cid] = asyncio.Queue()
        if renew:
            self._open.add(cid)

    def _forget(self, cid: str) -> None:
        self._queues.pop(cid, None)
        self._open.discard(cid)

    async def _send(self, msg: P.Request) -> None:
        try:
            await asyncio.wait_for(self._sock.send(P.encode(msg)), self.timeout)
        except asyncio.TimeoutError:
            self._forget(msg.id)
            raise self._timeout_error() from None

    async def _call(self, msg: P.Request, renew: bool = False) -> P.Reply:
        self._register(msg.id, renew)
        try:
            await self._send(msg)
            return await self._wait(msg.id)
        finally:
            self._forget(msg.id)

    async def _wait(self, cid: str) -> P.Reply:
        queue = self._queues[cid]
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), self.timeout)
            except asyncio.TimeoutError:
                raise self._timeout_error() from None
            reply = self._unwrap(item)
            if reply is not None:
                return reply

    def _put(self, cid: str, item: Any) -> None:
        queue = self._queues.get(cid)
        if queue is not None:
            queue.put_nowait(item)

    async def _reader(self) -> None:
        while True:
            self._route(await self._sock.recv(), self._put)

    async def _pinger(self) -> None:
        while True:
            await asyncio.sleep(self.keepalive_s)
            if self._open:
                try:
                    await self._send(self._msg(P.KeepAlive, request_ids=sorted(self._open)))
                except SplashError:
                    pass  # waiters time out on their own


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


if __name__ == "__main__":
    sys.exit(main())
