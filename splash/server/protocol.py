"""Client ↔ server wire protocol of `splash serve` (ZeroMQ DEALER → ROUTER, one msgpack frame
per message).

Every message is a msgspec struct in a tagged union (field ``type``), carries ``v`` (checked
against PROTOCOL_VERSION on every message) and ``id`` (the client's correlation id, echoed on
every reply; for ``generate`` it is also the engine's request id). Decoding is strict: unknown
fields, wrong types and frames over the size limit are ProtocolErrors, answered with an
``error`` reply and never fatal to the server.

Requests: generate, abort, stats, switch_layout, health, keepalive, update_weights.
Replies:  delta (stream tokens), final (RequestOutput), stats, ok, health, alive, error.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from splash.errors import (
    ConfigError,
    InvalidRequestError,
    LayoutInfeasibleError,
    NotFoundError,
    ProtocolError,
    RequestTimeoutError,
    ServerError,
    SplashError,
    WorkerDiedError,
)
from splash.outputs import Logprobs, RequestOutput
from splash.sampling_params import SamplingParams

PROTOCOL_VERSION = 1
DEFAULT_MAX_FRAME_BYTES = 4 << 20  # 4 MiB; the socket's hard MAXMSGSIZE is twice this

RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
TokenId = Annotated[int, msgspec.Meta(ge=0)]


# ----------------------------------------------------------------------------- requests
class Request(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, kw_only=True):
    v: int  # sender's PROTOCOL_VERSION
    id: RequestId  # correlation id, echoed by every reply to this message
    token: str = ""  # shared secret; required when the server has one (health excepted)


class Generate(Request, tag="generate"):
    prompt_token_ids: list[TokenId]
    params: dict[str, Any] = {}  # SamplingParams fields; validated server-side
    stream: bool = False  # True: a delta per engine step, then final; False: final only


class Abort(Request, tag="abort"):
    request_id: RequestId  # the generate id to abort


class Stats(Request, tag="stats"):
    pass


class SwitchLayout(Request, tag="switch_layout"):
    layout: Annotated[str, msgspec.Meta(max_length=16)]


class Health(Request, tag="health"):
    pass


class UpdateWeights(Request, tag="update_weights"):
    """Load a checkpoint directory's weights in place (same architecture), between rounds."""

    path: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]  # on the server's host


class KeepAlive(Request, tag="keepalive"):
    """Lease renewal: the client still waits on these generate ids (sent about once a second)."""

    request_ids: Annotated[list[RequestId], msgspec.Meta(max_length=65536)]


AnyRequest = Generate | Abort | Stats | SwitchLayout | Health | KeepAlive | UpdateWeights


# ----------------------------------------------------------------------------- replies
class Reply(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, kw_only=True):
    v: int = PROTOCOL_VERSION
    id: str  # correlation id of the request answered ("" if it could not be read)


class Delta(Reply, tag="delta"):
    token_ids: list[int]  # tokens produced by one engine step (sample 0 when n > 1)
    logprobs: list[Logprobs] | None = None  # theirs, when the request asked for logprobs


class Final(Reply, tag="final"):
    output: RequestOutput  # the whole output; a stream's unsent tail is in output.token_ids


class StatsReply(Reply, tag="stats"):
    stats: dict[str, Any]  # engine.stats() plus a "server" section


class Ok(Reply, tag="ok"):
    detail: str = ""


class HealthReply(Reply, tag="health"):
    healthy: bool
    detail: str = ""


class Alive(Reply, tag="alive"):
    alive: list[str]  # keepalive ids the server still runs for this client
    gone: list[str]  # ids it does not know (finished and delivered, aborted, or never seen)


class Error(Reply, tag="error"):
    code: str  # see ERROR_CODES
    message: str


AnyReply = Delta | Final | StatsReply | Ok | HealthReply | Alive | Error

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(AnyRequest)
_reply_decoder = msgspec.msgpack.Decoder(AnyReply)
_loose_decoder = msgspec.msgpack.Decoder()


def encode(msg: Request | Reply) -> bytes:
    return _encoder.encode(msg)


def decode_request(frame: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> AnyRequest:
    """Strictly decode one request frame; raise ProtocolError saying what is wrong."""
    if len(frame) > max_frame_bytes:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds the {max_frame_bytes}-byte limit")
    try:
        msg = _request_decoder.decode(frame)
    except msgspec.DecodeError as e:
        raise ProtocolError(_explain(frame, e)) from None
    if msg.v != PROTOCOL_VERSION:
        raise ProtocolError(_version_message(msg.v))
    return msg


def decode_reply(frame: bytes) -> AnyReply:
    try:
        msg = _reply_decoder.decode(frame)
    except msgspec.DecodeError as e:
        raise ProtocolError(f"malformed reply from server: {e}") from None
    if msg.v != PROTOCOL_VERSION:
        raise ProtocolError(_version_message(msg.v))
    return msg


def salvage_id(frame: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> str:
    """The ``id`` of a frame that failed strict decoding, if one can be read; else ""."""
    if len(frame) > max_frame_bytes:
        return ""
    try:
        raw = _loose_decoder.decode(frame)
    except Exception:
        return ""
    rid = raw.get("id") if isinstance(raw, dict) else None
    return rid if isinstance(rid, str) and 0 < len(rid) <= 128 else ""


def _version_message(v: object) -> str:
    return f"protocol version {v!r} is not supported (this side speaks {PROTOCOL_VERSION})"


def _explain(frame: bytes, err: msgspec.DecodeError) -> str:
    try:
        raw = _loose_decoder.decode(frame)
    except Exception:
        return f"frame is not valid msgpack ({err})"
    if not isinstance(raw, dict):
        return f"message must be a msgpack map, got {type(raw).__name__}"
    if "v" in raw and raw["v"] != PROTOCOL_VERSION:
        return _version_message(raw["v"])
    kind = raw.get("type", "untyped")
    kind = kind if isinstance(kind, str) and len(kind) <= 32 else "unknown"
    return f"malformed {kind!r} message: {err}"


def parse_params(params: dict[str, Any]) -> SamplingParams:
    try:
        return msgspec.convert(params, SamplingParams)
    except msgspec.ValidationError as e:
        raise InvalidRequestError(f"bad sampling params: {e}") from None


def params_to_wire(params: SamplingParams | None) -> dict[str, Any]:
    return {} if params is None else msgspec.to_builtins(params)


# ----------------------------------------------------------------------------- errors
# Most specific first: error_code() takes the first class the exception is an instance of.
ERROR_CODES: dict[str, type[SplashError]] = {
    "worker_died": WorkerDiedError,
    "not_found": NotFoundError,
    "layout_infeasible": LayoutInfeasibleError,
    "config": ConfigError,
    "invalid_request": InvalidRequestError,
    "protocol": ProtocolError,
    "unauthorized": ProtocolError,
    "timeout": RequestTimeoutError,
    "server": ServerError,
}


def error_code(exc: BaseException) -> str:
    for code, cls in ERROR_CODES.items():
        if isinstance(exc, cls):
            return code
    return "server"


def error_from_reply(reply: Error) -> SplashError:
    """The SplashError subclass a client raises for an error reply, carrying its message."""
    return ERROR_CODES.get(reply.code, ServerError)(reply.message)
