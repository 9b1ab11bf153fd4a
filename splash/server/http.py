"""OpenAI-compatible HTTP front end (standard library only): `/v1/completions`,
`/v1/chat/completions` (SSE with ``"stream": true``), `/v1/models`, `/health`, `/metrics`.

Threads, not the engine: each HTTP request runs in its own thread and talks to the engine
thread through the ZeroMQ server's inproc endpoint with a ``Client`` — the same protocol,
leases and aborts as remote clients; the engine is only ever touched by its one thread. A
client that disconnects mid-stream breaks the socket write; the stream is then closed, which
aborts the request. With a server token every endpoint but `/health` wants
``Authorization: Bearer <token>``. Prompts: token-id lists always; text when the model has a
tokenizer; chat needs a tokenizer with a chat template.
"""

from __future__ import annotations

import hmac
import json
import threading
import time
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from splash.client import Client
from splash.detokenize import IncrementalDetokenizer
from splash.errors import NO_TOKENIZER, InvalidRequestError, SplashError
from splash.logging_utils import get_logger
from splash.outputs import CompletionOutput, Logprobs
from splash.sampling_params import SamplingParams
from splash.server import protocol as P
from splash.server.metrics import CONTENT_TYPE, render_metrics

logger = get_logger(__name__)

_STATUS = {"invalid_request": 400, "config": 400, "layout_infeasible": 400, "protocol": 400,
           "unauthorized": 401, "not_found": 404, "worker_died": 503, "timeout": 504}
_PARAM_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids",
               "ignore_eos", "stop", "min_tokens", "n", "prompt_logprobs")
# OpenAI parameters the engine does not implement: a request setting one to anything but its
# neutral value gets a 400 instead of being silently ignored
_UNSUPPORTED = ("echo", "best_of", "logit_bias", "presence_penalty", "frequency_penalty",
                "suffix")
_NEUTRAL: tuple[Any, ...] = (None, False, 0, "", [], {})


class OpenAIHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, port: int, zmq_endpoint: str, context: Any,
                 token: str | None, tokenizer: Any, model_name: str,
                 max_body_bytes: int = P.DEFAULT_MAX_FRAME_BYTES,
                 request_timeout_s: float = 30.0) -> None:
        super().__init__((host, port), _Handler)
        self.zmq_endpoint, self.context, self.token = zmq_endpoint, context, token
        self.tokenizer, self.model_name = tokenizer, model_name
        self.max_body_bytes, self.request_timeout_s = max_body_bytes, request_timeout_s

    def client(self) -> Client:
        return Client(self.zmq_endpoint, timeout=self.request_timeout_s, token=self.token or "",
                      context=self.context)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.serve_forever, name="splash-http", daemon=True)
        thread.start()
        return thread


class _Handler(BaseHTTPRequestHandler):
    server: OpenAIHTTPServer
    protocol_version = "HTTP/1.0"  # one request per connection; SSE ends by closing

    def log_message(self, fmt: str, *args: Any) -> None:
        logger.debug("http %s " + fmt, self.client_address[0], *args)

    # ------------------------------------------------------------------ routing
    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/health":
            self._guard(self._health, auth=False)
        elif path == "/metrics":
            self._guard(self._metrics)
        elif path == "/v1/models":
            self._guard(lambda: self._json(200, {"object": "list", "data": [
                {"id": self.server.model_name, "object": "model", "owned_by": "splash"}]}))
        else:
            self._error(404, "not_found", f"no route GET {path}")

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/v1/completions":
            self._guard(lambda: self._complete(chat=False))
        elif path == "/v1/chat/completions":
            self._guard(lambda: self._complete(chat=True))
        else:
            self._error(404, "not_found", f"no route POST {path}")

    def _guard(self, fn: Any, auth: bool = True) -> None:
        try:
            if auth and self.server.token:
                given = self.headers.get("Authorization", "").removeprefix("Bearer ").strip()
                if not hmac.compare_digest(given.encode(), self.server.token.encode()):
                    self._error(401, "unauthorized", "missing or wrong bearer token")
                    return
            fn()
        except SplashError as e:
            code = P.error_code(e)
            self._error(_STATUS.get(code, 500), code, str(e))
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as e:
            logger.exception("http handler failed")
            self._error(500, "server", f"{type(e).__name__}: {e}")

    # ------------------------------------------------------------------ endpoints
    def _health(self) -> None:
        try:
            with self.server.client() as c:
                healthy = c.health()
        except SplashError as e:
            self._json(503, {"status": "unhealthy", "detail": str(e)})
            return
        self._json(200 if healthy else 503, {"status": "ok" if healthy else "unhealthy"})

    def _metrics(self) -> None:
        with self.server.client() as c:
            body = render_metrics(c.stats()).encode()
        self._send(200, CONTENT_TYPE, body)

    def _complete(self, chat: bool) -> None:
        body = self._read_json()
        unsupported = [k for k in _UNSUPPORTED
                       if k in body and not any(body[k] is v or body[k] == v for v in _NEUTRAL)]
        if unsupported:
            raise InvalidRequestError(
                f"{', '.join(unsupported)} {'is' if len(unsupported) == 1 else 'are'} not "
                "supported yet")
        prompt_ids = self._chat_prompt(body) if chat else self._text_prompt(body.get("prompt"))
        params = {k: body[k] for k in _PARAM_KEYS if body.get(k) is not None}
        k = _logprobs_k(body, chat)
        if k is not None:
            params["logprobs"] = k
        sampling = P.parse_params(params)
        if body.get("stream") and sampling.n > 1:
            raise InvalidRequestError("streaming n > 1 samples is not supported; send "
                                      "\"stream\": false")
        created, kind = int(time.time()), "chat.completion" if chat else "text_completion"
        with self.server.client() as c:
            if not body.get("stream"):
                out = c.generate(prompt_ids, sampling)
                samples = out.outputs or [CompletionOutput(  # an engine reporting one sample
                    0, out.token_ids, finish_reason=out.finish_reason, text=out.text,
                    stop_reason=out.stop_reason, logprobs=out.logprobs)]
                choices = [self._choice(chat, o.token_ids, o.finish_reason, final=True,
                                        text=self._final_text(o.token_ids, o.text, o.stop_reason),
                                        logprobs=o.logprobs, index=o.index)
                           for o in samples]
                completion = sum(len(o.token_ids) for o in samples)
                reply = {"id": f"cmpl-{out.request_id}", "object": kind, "created": created,
                         "model": self.server.model_name, "choices": choices, "usage": {
                             "prompt_tokens": len(prompt_ids), "completion_tokens": completion,
                             "total_tokens": len(prompt_ids) + completion}}
                if out.prompt_logprobs is not None:  # vLLM's extension
                    reply["prompt_logprobs"] = [None if d is None else {str(t): v for t, v in
                                                                        d.items()}
                                                for d in out.prompt_logprobs]
                self._json(200, reply)
                return
            self._stream(c, prompt_ids, sampling, chat, created, kind + ("" if not chat else ".chunk"))

    def _stream(self, c: Client, prompt_ids: list[int], sampling: SamplingParams, chat: bool,
                created: int, kind: str) -> None:
        # text that could still turn out to begin a stop string is held back (it is cut off)
        hold = max((len(s) for s in sampling.stop or []), default=1) - 1
        with c.stream(prompt_ids, sampling) as stream:
            first = next(stream, None)  # errors before the first token still get a JSON status
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()
            tok = self.server.tokenizer
            detok = None if tok is None else IncrementalDetokenizer(tok, prompt_ids)
            num_tokens, text, sent = 0, "", 0
            deltas = [] if first is None else [first]
            head = {"id": f"cmpl-{stream.request_id}", "object": kind, "created": created,
                    "model": self.server.model_name}
            try:
                for delta in _chain(deltas, stream):
                    logprobs = stream.logprobs[num_tokens:num_tokens + len(delta)]
                    num_tokens += len(delta)
                    text += "" if detok is None else detok.push(delta)
                    # the last tokens (output set) wait for the final text, cut at its stop
                    upto = max(len(text) - hold, sent) if stream.output is None else sent
                    choice = self._choice(chat, delta, None, final=False, text=text[sent:upto],
                                          logprobs=logprobs if sampling.logprobs is not None
                                          else None)
                    sent = upto
                    self._sse({**head, "choices": [choice]})
                out = stream.output
                if out is not None and isinstance(out.stop_reason, str) and out.text is not None:
                    text = out.text  # cut before the stop string
                elif detok is not None:
                    text += detok.finish()
                reason = out.finish_reason if out else None
                self._sse({**head, "choices": [self._choice(chat, [], reason, final=False,
                                                             text=text[sent:])]})
            except SplashError as e:  # headers are out: report in-band
                self._sse({"error": {"message": str(e), "code": P.error_code(e)}})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

    # ------------------------------------------------------------------ helpers
    def _text_prompt(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        if isinstance(prompt, str):
            tok = self.server.tokenizer
            if tok is None:
                raise InvalidRequestError(f"{NO_TOKENIZER}: send `prompt` as a list of token ids")
            return list(tok.encode(prompt))
        raise InvalidRequestError("`prompt` must be one string or one non-empty list of token ids")

    def _chat_prompt(self, body: dict[str, Any]) -> list[int]:
        tok = self.server.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise InvalidRequestError(
                "chat completions need a tokenizer with a chat template" +
                (f"; {NO_TOKENIZER}" if tok is None else "; this tokenizer has none") +
                ": use /v1/completions with token ids")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("`messages` must be a non-empty list")
        try:
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as e:  # a message the template cannot render (missing keys, roles)
            raise InvalidRequestError(f"the chat template cannot render `messages`: "
                                      f"{type(e).__name__}: {e}") from None
        # transformers 5 returns a BatchEncoding (a mapping); older versions a list of ids
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)

    def _decode(self, ids: list[int]) -> str:
        tok = self.server.tokenizer
        return "" if tok is None or not ids else tok.decode(ids, skip_special_tokens=True)

    def _final_text(self, ids: list[int], text: str | None, stop_reason: object) -> str:
        """The whole text of a finished sample: the engine's, cut before its stop string."""
        return text if isinstance(stop_reason, str) and text is not None else self._decode(ids)

    def _token_text(self, token: int) -> str:
        return self._decode([token]) if self.server.tokenizer is not None else f"token_id:{token}"

    def _choice(self, chat: bool, ids: list[int], reason: str | None, final: bool,
                text: str | None = None, logprobs: list[Logprobs] | None = None,
                index: int = 0) -> dict[str, Any]:
        text = self._decode(ids) if text is None else text
        lp = None if logprobs is None else self._logprobs(chat, ids, logprobs)
        if chat:
            body = {"role": "assistant", "content": text}
            return {"index": index, ("message" if final else "delta"): body, "token_ids": ids,
                    "logprobs": lp, "finish_reason": reason}
        return {"index": index, "text": text, "token_ids": ids, "logprobs": lp,
                "finish_reason": reason}

    def _logprobs(self, chat: bool, ids: list[int], logprobs: list[Logprobs]) -> dict[str, Any]:
        """OpenAI's logprobs object: per token its logprob and the top alternatives (the
        chosen token first in each mapping, then the top-k)."""
        name = self._token_text
        if chat:
            return {"content": [{"token": name(t), "logprob": d[t], "top_logprobs": [
                {"token": name(a), "logprob": v} for a, v in _top(d, t)]}
                for t, d in zip(ids, logprobs)]}
        return {"tokens": [name(t) for t in ids],
                "token_logprobs": [d[t] for t, d in zip(ids, logprobs)],
                "top_logprobs": [dict((name(a), v) for a, v in _top(d, t))
                                 for t, d in zip(ids, logprobs)]}

    def _read_json(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        if not 0 < length <= self.server.max_body_bytes:
            raise InvalidRequestError(f"body must be 1..{self.server.max_body_bytes} bytes of JSON")
        try:
            body = json.loads(self.rfile.read(length))
        except ValueError as e:
            raise InvalidRequestError(f"body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise InvalidRequestError("body must be a JSON object")
        return body

    def _sse(self, obj: dict[str, Any]) -> None:
        self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        self.wfile.flush()

    def _json(self, status: int, obj: dict[str, Any]) -> None:
        self._send(status, "application/json", json.dumps(obj).encode())

    def _error(self, status: int, code: str, message: str) -> None:
        try:
            self._json(status, {"error": {"message": message, "type": code, "code": code}})
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _send(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _top(d: Logprobs, chosen: int) -> list[tuple[int, float]]:
    """The top-k of a position's mapping (chosen token first, then the top-k): the chosen
    token counts only when it is one of them."""
    rest = list(d.items())[1:]
    if rest and d[chosen] < min(v for _, v in rest):
        return rest
    return sorted(d.items(), key=lambda kv: -kv[1])


def _logprobs_k(body: dict[str, Any], chat: bool) -> int | None:
    """Top-k logprobs asked for: completions' integer ``logprobs``; chat's ``logprobs: true``
    with ``top_logprobs`` (default 0)."""
    if not chat:
        k = body.get("logprobs")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int)):
            raise InvalidRequestError("`logprobs` must be an integer (top-k) for completions")
        return k
    if not body.get("logprobs"):
        if body.get("top_logprobs"):
            raise InvalidRequestError("`top_logprobs` needs `logprobs: true`")
        return None
    k = body.get("top_logprobs") or 0
    if isinstance(k, bool) or not isinstance(k, int):
        raise InvalidRequestError("`top_logprobs` must be an integer")
    return k


def _chain(first: list[list[int]], rest: Any) -> Any:
    yield from first
    yield from rest
