"""``AsyncClient``: the asyncio twin of ``splash.client.Client`` (same methods, awaitable);
import it from ``splash.client``."""

from __future__ import annotations

import asyncio
from typing import Any

import zmq
import zmq.asyncio

from splash.client_common import _Base, _StreamState
from splash.errors import ProtocolError, SplashError
from splash.outputs import RequestOutput
from splash.sampling_params import SamplingParams
from splash.server import protocol as P


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
        """Switch live at the next step; under auto it stays pinned until "auto" releases it."""
        await self._call(self._msg(P.SwitchLayout, layout=layout))

    async def update_weights(self, path: str) -> str:
        """Load a checkpoint directory (on the server's host) in place, between rounds: the
        server refuses while requests are in flight."""
        reply = await self._call(self._msg(P.UpdateWeights, path=str(path)))
        return reply.detail  # type: ignore[attr-defined]

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
