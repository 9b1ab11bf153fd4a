"""What the blocking and the asyncio client share: message building, reply routing and
stream state (``splash.client`` is the public module)."""

from __future__ import annotations

import uuid
from typing import Any

import zmq

from splash import envs
from splash.errors import ConfigError, InvalidRequestError, ProtocolError, RequestTimeoutError
from splash.outputs import Logprobs, RequestOutput
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
        if isinstance(prompt_ids, (str, bytes)):  # list("hi") would go out as two "ids"
            raise InvalidRequestError(
                "the ZMQ client sends token ids, not text: encode the prompt with the model's "
                "tokenizer first, or send text to the HTTP server (/v1/completions)")
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
        self.logprobs: list[Logprobs] = []  # of the tokens yielded so far (logprobs=k asked)
        self._received = 0

    def _take(self, reply: P.Reply) -> list[int]:
        if isinstance(reply, P.Delta):
            self._received += len(reply.token_ids)
            self.logprobs += reply.logprobs or []
            return list(reply.token_ids)
        if isinstance(reply, P.Final):
            self.output, self.done = reply.output, True
            tail = reply.output.token_ids[self._received:]  # final carries what deltas did not
            self._received = len(reply.output.token_ids)
            self.logprobs += (reply.output.logprobs or [])[len(self.logprobs):]
            return list(tail)
        raise ProtocolError(f"unexpected {type(reply).__name__} reply in a stream")


# ----------------------------------------------------------------------------- blocking
