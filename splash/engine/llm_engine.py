"""LLMEngine: the controller. Schedules, owns every rank's pages, decides and plans layout
switches, and drives the workers one step at a time. It holds no device tensors.

One step reads like the design: (switch plan) → schedule → execute → update.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from splash.core.request import Request, Status
from splash.engine.auto_layout import AutoLayout
from splash.engine.config import EngineConfig
from splash.engine.plans import build_plans
from splash.engine.setup import EngineSetup
from splash.engine.switches import SwitchController
from splash.errors import InvalidRequestError, WorkerDiedError
from splash.logging_utils import get_logger
from splash.outputs import RequestOutput
from splash.sampling_params import SamplingParams

logger = get_logger("splash.engine")


class LLMEngine:
    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.setup = EngineSetup(cfg)
        s = self.setup
        self.model_cfg, self.world = s.model_cfg, cfg.tp_size
        self.scheduler, self.allocators = s.scheduler, s.allocators
        self.switches = SwitchController(self)
        if cfg.layout == "auto" and cfg.tp_size > 1:
            self.switches.policy = AutoLayout(s, cfg.policy_margin)
        self.executor = s.start_executor()
        self.tokenizer = s.load_tokenizer()
        self.vocab_size = self.model_cfg.vocab_size
        self.requests: dict[str, Request] = {}
        self.step_count = 0
        self.healthy = True
        self._ids = itertools.count()
        self._pending_outputs: list[RequestOutput] = []
        self._tokens_total = 0
        self._graph_steps = 0
        self._step_ms_ema: float | None = None
        self._started = time.monotonic()

    @classmethod
    def from_args(cls, **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig(**kwargs))

    # -- requests -------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        self._validate(prompt_token_ids, params)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if not isinstance(rid, str) or not rid or not rid.isprintable():
            # control characters are reserved (CUDA-graph padding rows use them)
            raise InvalidRequestError(f"request id {rid!r} must be non-empty printable text")
        if rid in self.requests:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        req = Request(rid, list(prompt_token_ids), params)
        self.requests[rid] = req
        self.scheduler.add(req)
        return rid

    def _validate(self, prompt: list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be a SamplingParams")
        if not isinstance(prompt, (list, tuple)) or len(prompt) == 0:
            raise InvalidRequestError("prompt must be a non-empty list of token ids")
        bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int)
               or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token id {bad[0]!r} is not an int in [0, {self.vocab_size}) (vocab size)")
        limit = self.setup.max_model_len
        if len(prompt) + params.max_tokens > limit:
            raise InvalidRequestError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len {limit}")
        if len(prompt) + params.max_tokens > self.setup.max_request_tokens:
            raise InvalidRequestError(
                f"prompt + max_tokens = {len(prompt) + params.max_tokens} tokens does not fit "
                f"the KV pool ({self.setup.max_request_tokens} tokens per request)")

    def abort_request(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None or req.status is Status.FINISHED:
            return False
        self.scheduler.finish(req, "abort")
        self._pending_outputs.append(self._output(req, []))
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending_outputs)

    # -- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if not self.healthy:
            raise WorkerDiedError("the worker group is down; restart the engine")
        outputs, self._pending_outputs = self._pending_outputs, []
        for out in outputs:
            self.requests.pop(out.request_id, None)
        switch = self.switches.prepare(self.step_count)
        batch = self.scheduler.schedule(
            allow_preemption=switch is None and self.switches.inflight is None)
        if not batch.entries and switch is None and self.switches.inflight is None:
            return outputs
        plans = build_plans(self, batch, switch)
        t0 = time.perf_counter()
        try:
            results = self.executor.execute(plans)
        except WorkerDiedError as e:
            return outputs + self._fail_all(str(e))
        step_ms = (time.perf_counter() - t0) * 1e3
        self.switches.finish(switch, results, step_ms, self.step_count, batch)
        self._step_ms_ema = step_ms if self._step_ms_ema is None else (
            0.9 * self._step_ms_ema + 0.1 * step_ms)
        self.step_count += 1
        self._graph_steps += int(all(r.graph_replay for r in results))
        outputs += self._update(batch, results[0].tokens)
        for out in outputs:  # finished requests leave the table (ids may be reused)
            if out.finished:
                self.requests.pop(out.request_id, None)
        return outputs

    def _update(self, batch, tokens: list[int]) -> list[RequestOutput]:
        outputs = []
        it = iter(tokens)
        for req, n in batch.entries:
            req.num_computed += n
            if req.num_computed < req.num_tokens or req.status is Status.FINISHED:
                continue
            token = next(it)
            req.output_token_ids.append(token)
            self._tokens_total += 1
            if req.first_token_s is None:
                req.first_token_s = time.monotonic()
            reason = self._finish_reason(req, token)
            if reason:
                self.scheduler.finish(req, reason)
            outputs.append(self._output(req, [token]))
        return outputs

    def _finish_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        if not p.ignore_eos and token in self.model_cfg.eos_token_ids:
            return "stop"
        if p.stop_token_ids and token in p.stop_token_ids:
            return "stop"
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.setup.max_model_len:
            return "length"
        return None

    def _output(self, req: Request, new: list[int]) -> RequestOutput:
        finished = req.status is Status.FINISHED
        text = None
        if self.tokenizer is not None and finished:
            text = self.tokenizer.decode(req.output_token_ids)
        return RequestOutput(req.request_id, req.prompt_token_ids, list(req.output_token_ids),
                             new_token_ids=new, finished=finished,
                             finish_reason=req.finish_reason, error=req.error, text=text)

    def _fail_all(self, message: str) -> list[RequestOutput]:
        logger.error("worker failure: %s — failing all in-flight requests", message)
        self.healthy = False
        outputs = []
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.scheduler.finish(req, "error", message)
            outputs.append(self._output(req, []))
        raise WorkerDiedError(message)

    # -- control and introspection ----------------------------------------------------------
    @property
    def step_ms_ema(self) -> float | None:
        """Moving average of the step time (ms), None before the first step."""
        return self._step_ms_ema

    def switch_layout(self, name: str) -> None:
        self.switches.request(name)

    @property
    def layout(self) -> str:
        return self.scheduler.layout.name

    def is_healthy(self) -> bool:
        if self.healthy and not self.executor.alive():
            self.healthy = False
        return self.healthy

    def stats(self) -> dict[str, Any]:
        elapsed = max(time.monotonic() - self._started, 1e-9)
        return {
            "layout": self.layout,
            "layout_pinned": self.switches.pinned,  # under auto: held by a manual switch
            "switches": self.switches.history,
            "deferred_switches": self.switches.deferred,
            "cancelled_switches": self.switches.cancelled,
            "switch_in_flight": None if self.switches.inflight is None else {
                "from": self.switches.inflight.manifest.src.name,
                "to": self.switches.inflight.manifest.dst.name,
                "decision_step": self.switches.inflight.step},
            "policy_decisions": self.switches.decisions[-50:],
            "kv_capacity_tokens": self.setup.kv_capacity_tokens(),
            "kv_pages_used": self.allocators.used(),
            "kv_pages_total": self.setup.num_pages,
            "page_size": self.setup.page_size,
            "num_waiting": len(self.scheduler.waiting),
            "num_running": len(self.scheduler.running),
            "num_steps": self.step_count,
            "num_preemptions": self.scheduler.num_preemptions,
            "cuda_graphs": self.setup.cuda_graphs,
            "graph_steps": self._graph_steps,  # steps replayed from CUDA graphs
            "step_time_ms_ema": self._step_ms_ema,
            "tokens_generated": self._tokens_total,
            "tokens_per_s": self._tokens_total / elapsed,
            "worker_pids": list(self.executor.pids),
            "healthy": self.healthy,
            "backend": self.setup.backend_name,
            "tp_size": self.world,
        }

    def shutdown(self) -> None:
        self.executor.shutdown()
