"""The controller's front door: one ZeroMQ ROUTER socket and the one thread that drives the
engine.

Loop: poll the socket (0 ms when the engine has work, ``idle_poll_ms`` when idle) → handle
every waiting message → expire client leases → ``engine.step()`` → send each output to the
identity that asked for it (a ``delta`` per step when streaming, then ``final``).

Liveness: a request is leased to its client. The client renews the lease with ``keepalive``
(about once a second while it waits); a request whose client has been silent for
``client_timeout_s`` is aborted and its pages freed. Clients also send ``abort`` when a stream
is closed early, so the lease is the safety net for crashed or vanished clients.

Faults: a bad frame gets an ``error`` reply (or, above the socket's hard size limit, ZeroMQ
drops it and the disconnect is logged); it never stops the loop. When ``engine.step()``
raises (WorkerDiedError, or anything else: the engine's state is then unknown) every
in-flight request gets an ``error`` reply at once, health turns false, the server keeps
answering for ``fail_grace_s`` and then returns a non-zero exit code, so a supervisor
(Docker, systemd, k8s) restarts it.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from splash.core.pause import PauseClock
from splash.engine.api import EngineAPI
from splash.errors import InvalidRequestError, NotFoundError, ProtocolError, WorkerDiedError
from splash.logging_utils import get_logger
from splash.outputs import RequestOutput
from splash.server import protocol as P

logger = get_logger(__name__)

EXIT_ENGINE_FAILED = 3


@dataclass(frozen=True)
class ServerConfig:
    token: str | None = None  # shared secret every message but health must carry
    max_frame_bytes: int = P.DEFAULT_MAX_FRAME_BYTES  # larger frames get an error reply
    client_timeout_s: float = 10.0  # lease: abort requests of a client silent this long
    idle_poll_ms: int = 50  # poll timeout while the engine has nothing to do
    fail_grace_s: float = 2.0  # after a fatal engine error: answer (unhealthy) this long
    max_recv_per_turn: int = 1024  # messages handled between two engine steps

    def __post_init__(self) -> None:
        if self.max_frame_bytes < 1024:
            raise ValueError(f"max_frame_bytes must be >= 1024, got {self.max_frame_bytes}")
        if self.client_timeout_s <= 0 or self.fail_grace_s < 0:
            raise ValueError("client_timeout_s must be > 0 and fail_grace_s >= 0")


@dataclass
class _Lease:
    identity: bytes  # ROUTER identity of the client that sent generate
    stream: bool
    last_seen: float  # monotonic time of the client's last generate/keepalive


@dataclass
class _Counters:
    requests_total: int = 0
    requests_finished: int = 0
    protocol_errors: int = 0
    request_errors: int = 0
    aborts: int = 0
    lease_expired: int = 0
    dropped_connections: int = 0


class ZmqServer:
    """Serve ``engine`` (an LLMEngine, or anything with its methods) on ``endpoint``.

    Also binds ``inproc_endpoint`` on ``context`` so in-process front ends (the HTTP server)
    reach the engine thread through the same protocol instead of touching the engine.
    """

    def __init__(self, engine: EngineAPI, endpoint: str, config: ServerConfig | None = None,
                 context: zmq.Context | None = None) -> None:
        self.engine = engine
        self.config = config or ServerConfig()
        self.context = context or zmq.Context.instance()
        self._sock = self.context.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.config.max_frame_bytes)
        self._sock.setsockopt(zmq.LINGER, 2000)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # never drop replies; leases bound the backlog
        self._sock.setsockopt(zmq.RCVHWM, 0)
        if endpoint.startswith("tcp://["):
            self._sock.setsockopt(zmq.IPV6, 1)
        self._sock.bind(endpoint)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.inproc_endpoint = f"inproc://splash-serve-{id(self):x}"
        self._sock.bind(self.inproc_endpoint)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._leases: dict[str, _Lease] = {}
        self._counters = _Counters()
        self._stop = threading.Event()
        self._failure: str | None = None  # set once the engine failed: the reason
        self._failed_at = 0.0
        self._exit_code = 0
        self._next_lease_check = 0.0
        self._turns = PauseClock()  # the loop's own pauses do not count as clients' silence
        self._next_health_check = 0.0
        self._bad_log_times: list[float] = []

    # ------------------------------------------------------------------ loop
    def serve_forever(self) -> int:
        """Run until stop() or a fatal engine error; return the process exit code."""
        logger.info("serving on %s", self.endpoint)
        try:
            while not self._stop.is_set():
                busy = self._failure is None and self.engine.has_unfinished()
                events = dict(self._poller.poll(0 if busy else self.config.idle_poll_ms))
                if self._sock in events:
                    self._drain()
                if self._monitor in events:
                    self._drain_monitor()
                self._expire_leases()
                self._check_health()
                if self._failure is not None:
                    if time.monotonic() - self._failed_at >= self.config.fail_grace_s:
                        break
                elif self.engine.has_unfinished():
                    self._step()
        finally:
            self._close()
        return self._exit_code

    def stop(self) -> None:
        """Ask the loop to exit (thread- and signal-safe); in-flight requests get an error."""
        self._stop.set()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except WorkerDiedError as e:
            self._fail_all(f"worker died: {e}")
            return
        except Exception as e:  # the engine's state is unknown after this: fail and restart
            logger.exception("engine step failed")
            self._fail_all(f"engine step failed: {type(e).__name__}: {e}")
            return
        for out in outputs:
            self._deliver(out)

    def _check_health(self) -> None:
        """About once a second: a worker that died while the engine was idle is noticed here
        (a busy engine notices it in step())."""
        now = time.monotonic()
        if self._failure is None and now >= self._next_health_check:
            self._next_health_check = now + 1.0
            if not self.engine.is_healthy():
                self._fail_all("worker died: the engine reports its worker group down")

    def _deliver(self, out: RequestOutput) -> None:
        lease = self._leases.get(out.request_id)
        if lease is None:
            return  # aborted after its client vanished
        if out.finished:
            del self._leases[out.request_id]
            self._counters.requests_finished += 1
            self._send(lease.identity, P.Final(id=out.request_id, output=out))
        elif lease.stream and out.new_token_ids:
            lps = None if out.logprobs is None else out.logprobs[-len(out.new_token_ids):]
            self._send(lease.identity, P.Delta(id=out.request_id, token_ids=out.new_token_ids,
                                               logprobs=lps))

    def _fail_all(self, reason: str) -> None:
        logger.error("%s; failing %d in-flight requests and exiting", reason, len(self._leases))
        self._failure, self._failed_at = reason, time.monotonic()
        self._exit_code = EXIT_ENGINE_FAILED
        for rid, lease in self._leases.items():
            self._send(lease.identity, P.Error(id=rid, code="worker_died", message=reason))
        self._leases.clear()

    def _close(self) -> None:
        for rid, lease in self._leases.items():
            msg = "server shutting down"
            self._send(lease.identity, P.Error(id=rid, code="server", message=msg))
        self._leases.clear()
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close()  # LINGER lets the last replies out

    # ------------------------------------------------------------------ messages
    def _drain(self) -> None:
        for _ in range(self.config.max_recv_per_turn):
            try:
                parts = self._sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            identity, frames = parts[0], parts[1:]
            if len(frames) != 1:
                self._bad(identity, "", f"expected one frame per message, got {len(frames)}")
                continue
            self._handle(identity, frames[0])

    def _handle(self, identity: bytes, frame: bytes) -> None:
        try:
            msg = P.decode_request(frame, self.config.max_frame_bytes)
        except ProtocolError as e:
            self._bad(identity, P.salvage_id(frame, self.config.max_frame_bytes), str(e))
            return
        if not isinstance(msg, P.Health) and not self._authorized(msg.token):
            self._bad(identity, msg.id, "missing or wrong token", code="unauthorized")
            return
        try:
            reply = self._dispatch(identity, msg)
        except Exception as e:
            code = P.error_code(e)
            if code == "server":
                logger.exception("handling %s failed", type(msg).__name__)
            self._counters.request_errors += 1
            reply = P.Error(id=msg.id, code=code, message=str(e) or type(e).__name__)
        if reply is not None:
            self._send(identity, reply)

    def _dispatch(self, identity: bytes, msg: P.AnyRequest) -> P.Reply | None:
        if isinstance(msg, P.Health):
            healthy = self._failure is None and bool(self.engine.is_healthy())
            return P.HealthReply(id=msg.id, healthy=healthy, detail=self._failure or "ok")
        if self._failure is not None:
            raise WorkerDiedError(f"server is failing and will exit: {self._failure}")
        if isinstance(msg, P.Generate):
            return self._generate(identity, msg)
        if isinstance(msg, P.KeepAlive):
            return self._keepalive(identity, msg)
        if isinstance(msg, P.Abort):
            if not self.engine.abort_request(msg.request_id):
                raise NotFoundError(f"no running request {msg.request_id!r}")
            self._counters.aborts += 1
            return P.Ok(id=msg.id, detail="aborted")
        if isinstance(msg, P.Stats):
            return P.StatsReply(id=msg.id, stats=self.stats())
        if isinstance(msg, P.SwitchLayout):
            self.engine.switch_layout(msg.layout)
            return P.Ok(id=msg.id, detail=f"switch to {msg.layout} requested")
        if isinstance(msg, P.UpdateWeights):  # refused while requests are in flight
            info = self.engine.update_weights(msg.path)
            return P.Ok(id=msg.id, detail=f"weights updated from {msg.path} ({info['tensors']} "
                        f"tensors, version {info['weight_version']})")
        raise ProtocolError(f"unhandled message type {type(msg).__name__}")

    def _generate(self, identity: bytes, msg: P.Generate) -> P.Reply | None:
        if msg.id in self._leases:
            raise InvalidRequestError(f"request id {msg.id!r} is already in flight")
        params = P.parse_params(msg.params)
        rid = self.engine.add_request(list(msg.prompt_token_ids), params, request_id=msg.id)
        self._leases[rid] = _Lease(identity, msg.stream, time.monotonic())
        self._counters.requests_total += 1
        return None  # the answer comes from engine steps

    def _keepalive(self, identity: bytes, msg: P.KeepAlive) -> P.Reply:
        now, alive, gone = time.monotonic(), [], []
        for rid in msg.request_ids:
            lease = self._leases.get(rid)
            if lease is not None and lease.identity == identity:
                lease.last_seen = now
                alive.append(rid)
            else:
                gone.append(rid)
        return P.Alive(id=msg.id, alive=alive, gone=gone)

    def _authorized(self, token: str) -> bool:
        expected = self.config.token
        if not expected:
            return True
        return hmac.compare_digest(token.encode(), expected.encode())

    def _bad(self, identity: bytes, rid: str, message: str, code: str = "protocol") -> None:
        self._counters.protocol_errors += 1
        self._log_bad(f"bad message ({code}): {message}")
        self._send(identity, P.Error(id=rid, code=code, message=message))

    def _log_bad(self, line: str, level: int = logging.WARNING) -> None:
        """At most 20 lines per 10 s; the rest at debug level, so a flood cannot fill logs."""
        now = time.monotonic()
        self._bad_log_times = [t for t in self._bad_log_times if now - t < 10.0]
        if len(self._bad_log_times) < 20:
            self._bad_log_times.append(now)
            logger.log(level, line)
        else:
            logger.debug(line)

    def _drain_monitor(self) -> None:
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)
            self._counters.dropped_connections += 1
            self._log_bad(f"peer disconnected ({event.get('endpoint')!r}): closed by the client, "
                          f"or a frame over the {2 * self.config.max_frame_bytes}-byte hard "
                          "limit was dropped", logging.INFO)

    def _expire_leases(self) -> None:
        paused = self._turns.pause()
        if paused:  # the process stopped, or a long step: the clients' renewals wait unread
            for lease in self._leases.values():
                lease.last_seen += paused
        now = time.monotonic()
        if now < self._next_lease_check or not self._leases:
            return
        self._next_lease_check = now + min(0.5, self.config.client_timeout_s / 4)
        expired = [r for r, ls in self._leases.items()
                   if now - ls.last_seen > self.config.client_timeout_s]
        for rid in expired:
            del self._leases[rid]
            self._counters.lease_expired += 1
            logger.info("client of %s silent for %.0f s: aborting it", rid,
                        self.config.client_timeout_s)
            if self._failure is None:
                self.engine.abort_request(rid)

    def _send(self, identity: bytes, reply: P.Reply) -> None:
        try:
            self._sock.send_multipart([identity, P.encode(reply)], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # peer gone: nothing to tell it
            logger.debug("reply to a vanished peer dropped: %s", e)

    def stats(self) -> dict[str, Any]:
        stats = dict(self.engine.stats())
        c = self._counters
        stats["healthy"] = self._failure is None and bool(self.engine.is_healthy())
        stats["server"] = {
            "requests_total": c.requests_total, "requests_finished": c.requests_finished,
            "requests_in_flight": len(self._leases), "protocol_errors": c.protocol_errors,
            "request_errors": c.request_errors, "aborts": c.aborts,
            "lease_expired": c.lease_expired, "dropped_connections": c.dropped_connections,
        }
        return stats
