"""`splash serve`: build the engine, open the ZeroMQ front door (and optionally HTTP), run the
engine loop in this (main) thread until SIGINT/SIGTERM or a fatal engine error.

Token rule: binding a non-loopback address needs a shared secret (``--token``, ``--token-file``
or SPLASH_TOKEN, first found wins); without one the server refuses to start. With a token,
every message but ``health`` must carry it (compared in constant time).

Fault policy: when a worker dies the server fails every in-flight request with
WorkerDiedError, reports unhealthy for a short grace period and exits with code 3, for the
supervisor (Docker ``restart:``, systemd, k8s) to restart it. Restarting in place is not
attempted: a fresh process is the one state known to be clean.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import socket
import sys
import threading
from typing import Any

from splash import envs
from splash.engine.llm_engine import LLMEngine
from splash.errors import ConfigError
from splash.logging_utils import get_logger
from splash.server.http import OpenAIHTTPServer
from splash.server.zmq_server import ServerConfig, ZmqServer

logger = get_logger(__name__)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname or interface name: may be reachable from outside


def resolve_token(token: str | None, token_file: str | None) -> str | None:
    if token:
        return token
    if token_file:
        try:
            with open(token_file) as f:
                text = f.read().strip()
        except OSError as e:
            raise ConfigError(f"cannot read --token-file {token_file}: {e}") from None
        if not text:
            raise ConfigError(f"--token-file {token_file} is empty")
        return text
    return envs.get("SPLASH_TOKEN") or None


def check_bind(host: str, token: str | None) -> None:
    if not is_loopback(host) and not token:
        raise ConfigError(
            f"refusing to bind {host}: serving beyond loopback needs a shared secret. Pass "
            "--token, --token-file or set SPLASH_TOKEN (clients send the same token), or bind "
            "127.0.0.1")


def check_ports_free(host: str, ports: list[int | None]) -> None:
    """Fail before the model loads when a port cannot be listened on (in use, bad host)."""
    bare = host.strip("[]")
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET
    for port in ports:
        if not port:
            continue  # None: not served; 0: any free port
        with socket.socket(family) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((bare, port))
            except OSError as e:
                raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def zmq_endpoint(host: str, port: int) -> str:
    host = host.strip("[]")
    if ":" in host:
        host = f"[{host}]"
    return f"tcp://{host}:{'*' if port == 0 else port}"


def serve_main(args: argparse.Namespace) -> int:
    """Entry of ``splash serve`` (args from splash.cli). Returns 0 after SIGINT/SIGTERM; exits
    the process with 3 after a fatal engine error."""
    token = resolve_token(args.token, args.token_file)
    check_bind(args.host, token)
    check_ports_free(args.host, [args.port, getattr(args, "http_port", None)])
    engine = LLMEngine.from_args(
        model=args.model, tp_size=args.tp_size, backend=args.backend, layout=args.layout,
        dtype=args.dtype, kv_dtype=args.kv_dtype, page_size=args.page_size,
        max_model_len=args.max_model_len, kv_pages_per_rank=args.kv_pages_per_rank,
        enforce_eager=args.enforce_eager, memory_fraction=args.memory_fraction,
        async_scheduling=getattr(args, "async_scheduling", True),
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    try:
        server = ZmqServer(engine, zmq_endpoint(args.host, args.port), ServerConfig(token=token))
    except Exception:
        engine.shutdown()
        raise
    print(f"splash serve: zmq {server.endpoint}", flush=True)
    http = _start_http(args, server, engine, token)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: server.stop())
    code = server.serve_forever()
    if http is not None:
        http.shutdown()
    _shutdown_engine(engine)
    if code != 0:
        logger.error("exiting with code %d for the supervisor to restart the server", code)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # worker processes may be wedged: do not wait for them at exit
    return code


def _start_http(args: argparse.Namespace, server: ZmqServer, engine: Any,
                token: str | None) -> Any:
    if getattr(args, "http_port", None) is None:
        return None
    http = OpenAIHTTPServer(args.host.strip("[]"), args.http_port, server.inproc_endpoint,
                            server.context, token, getattr(engine, "tokenizer", None),
                            os.path.basename(os.path.normpath(args.model)))
    http.start()
    print(f"splash serve: http http://{args.host}:{http.server_address[1]}", flush=True)
    return http


def _shutdown_engine(engine: Any, timeout_s: float = 10.0) -> None:
    """engine.shutdown(), bounded: a dead worker group must not hang the exit."""
    thread = threading.Thread(target=engine.shutdown, name="splash-shutdown", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        logger.warning("engine shutdown did not finish within %.0f s", timeout_s)
