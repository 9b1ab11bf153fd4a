"""LLMEngine: the controller. Schedules, owns every rank's pages, decides and plans layout
switches, and drives the workers one step at a time. It holds no device tensors.

One step: plan a switch (if one is due) → schedule → submit to the workers → update the
requests with the sampled tokens.

Asynchronous scheduling (``async_scheduling``, on by default): while the workers compute step
N, the controller already schedules and submits step N + 1, counting N's rows as computed and
N's draws as tokens in flight (`Scheduler.advance`); the workers read those tokens from N's
draws on the device. The device then never waits for the host between steps: planning, output
handling and the policy run while it computes. A request that stops at N (end of sequence, a
stop string, an abort) has computed one row in N + 1 for nothing; one that stops by length is
not scheduled again. A switch due at N + 1 is planned then too (its manifests count N's rows,
which the workers write before they move anything), so its planning also runs while the
device computes. The controller goes ahead from a step that draws one token per request,
switching steps included (the switch is already in the scheduler's tables; the pages it
discards are freed when its results come, after the step ahead was planned); otherwise (a
fork of n samples, or a request that could not get pages without preemption) the next step
is scheduled once N's tokens are known. Either way a call to ``step`` returns with the next
step submitted: changes between calls (new requests, aborts, a requested switch) take effect
from the step after it.
"""

from __future__ import annotations

import gc
import itertools
import os
import time
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from splash.core.protocol import StepPlan, StepResult
from splash.core.request import Request, SampleGroup, Status
from splash.engine.admission import check_request
from splash.engine.auto_layout import AutoLayout
from splash.engine.config import EngineConfig
from splash.engine.executor import sigint_deferred, start_executor
from splash.engine.graphs import startup_layouts
from splash.engine.output_processor import OutputProcessor
from splash.engine.plans import build_plans
from splash.engine.sampling_plan import num_draws
from splash.engine.scheduler import ScheduledBatch
from splash.engine.setup import (
    EngineSetup,
    build_scheduler,
    load_tokenizer,
    resolve_setup,
    size_from_profiles,
)
from splash.engine.step_profile import ProfileMarks
from splash.engine.switches import SwitchController, SwitchStep
from splash.engine.warmup import warm_up
from splash.errors import InvalidRequestError, StepFailedError, WorkerDiedError
from splash.logging_utils import get_logger
from splash.model.loader import weights_to_update
from splash.outputs import RequestOutput
from splash.sampling_params import SamplingParams

logger = get_logger("splash.engine")


@dataclass
class _Submitted:
    """A step issued to the workers whose results are not processed yet."""

    number: int
    batch: ScheduledBatch
    switch: SwitchStep | None
    precopy: bool  # a background pre-copy moves under it
    plans: list[StepPlan]
    t0: float  # submitted at (perf_counter)


class LLMEngine:
    """Implements `splash.engine.api.EngineAPI`."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        s = resolve_setup(cfg)  # refuses what cannot fit by the estimates, before any worker
        self.executor = start_executor(s.worker_config(), cfg.worker_addr)
        try:
            self._start(s)
        except BaseException:  # no worker outlives an engine that failed to start (a Ctrl-C
            gc.unfreeze()  # during start-up included: its workers ignore SIGINT)
            self.executor.shutdown()
            raise

    def _start(self, s: EngineSetup) -> None:
        """Everything after the workers spawned: the pool from what they measured (then they
        allocate it), the scheduler, the warm-up."""
        cfg = self.cfg
        self.setup = s = size_from_profiles(s, self.executor.profiles)
        ready = self.executor.allocate(s.num_pages)
        self._graphs_at_start = {"cuda_graphs_captured": max(r.graphs for r in ready),
                                 "cuda_graph_capture_s": max(r.graph_s for r in ready),
                                 "cuda_graph_mib": max(r.graph_bytes for r in ready) / 2**20}
        if s.cuda_graphs:
            logger.info("captured %d CUDA graphs for layouts %s in %.1f s, %.0f MiB (per rank, "
                        "%.0f MiB reserved)", self._graphs_at_start["cuda_graphs_captured"],
                        startup_layouts(s.fitting, s.initial_layout, s.world,
                                        s.resident_heads),
                        self._graphs_at_start["cuda_graph_capture_s"],
                        self._graphs_at_start["cuda_graph_mib"], s.budget.graphs / 2**20)
            if self._graphs_at_start["cuda_graph_mib"] * 2**20 > s.budget.graphs:
                logger.warning("the start-up CUDA graphs took more than their reserve: the "
                               "slack beyond memory_fraction pays the difference (lower "
                               "max_num_seqs or memory_fraction if memory runs short)")
        self.model_cfg, self.world = s.model_cfg, cfg.tp_size
        self.scheduler = build_scheduler(s)
        self.allocators = self.scheduler.alloc
        self.switches = SwitchController(self.scheduler, s)
        self.auto: AutoLayout | None = None
        if cfg.layout == "auto" and cfg.tp_size > 1:
            self.auto = self.switches.policy = AutoLayout(s, self.scheduler, cfg.policy_margin)
        self.tokenizer = load_tokenizer(cfg.model)
        self.vocab_size = self.model_cfg.vocab_size
        self.outputs = OutputProcessor(self.tokenizer, set(self.model_cfg.eos_token_ids),
                                       s.max_model_len)
        self.requests: dict[str, Request] = {}
        self.step_count = 0
        self.healthy = True
        self._ids = itertools.count()
        self._pending_outputs: list[RequestOutput] = []
        self._tokens_total = 0
        self._graph_steps = 0
        self._step_ms_ema: float | None = None
        self._ahead: _Submitted | None = None  # the step submitted, not completed yet
        self._steps_ahead = 0  # steps scheduled before the step before them was done
        self._profile = ProfileMarks()  # profile_steps() under way
        self._last_done = 0.0  # when the last step's results came back (perf_counter)
        self.weight_version = 0  # in-place weight updates so far
        self._started = time.monotonic()
        if cfg.warmup if cfg.warmup is not None else s.backend_name != "cpu":
            self.warm_up()
        # what start-up built lives as long as the engine: out of the collector's sight, its
        # full passes stop walking it (a pass over the weights' and pools' Python objects cost
        # up to a millisecond at random steps and switches). A Ctrl-C meanwhile waits until
        # it is done: raised inside a finalizer the collection runs, it would be swallowed
        with sigint_deferred():
            gc.collect()
            gc.freeze()

    @classmethod
    def from_args(cls, **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig(**kwargs))

    # -- requests -------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        check_request(prompt_token_ids, params, self.cfg, self.setup, self.vocab_size,
                      self.tokenizer is not None)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if not isinstance(rid, str) or not rid or not rid.isprintable():
            # control characters are reserved (CUDA-graph padding rows use them)
            raise InvalidRequestError(f"request id {rid!r} must be non-empty printable text")
        if rid in self.requests:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        req = Request(rid, list(prompt_token_ids), params)
        if params.n > 1:
            req.group = SampleGroup(rid, params.n, [req])
        self.outputs.start(req)
        self.requests[rid] = req
        self.scheduler.add(req)
        return rid

    def abort_request(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None:
            return False
        live = [m for m in (req.group.members if req.group is not None else [req])
                if m.status is not Status.FINISHED]
        if not live:
            return False
        for m in live:
            self.scheduler.finish(m, "abort")
        self._pending_outputs.append(self._output(req))
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending_outputs) or \
            self._ahead is not None

    # -- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if not self.healthy:
            raise WorkerDiedError("the worker group is down; restart the engine")
        outputs = self._take_pending()
        cur, self._ahead = self._ahead, None
        if cur is None:
            cur = self._submit_next()
            if cur is None:
                return outputs
        nxt = self._go_ahead(cur)
        done, ok = self._complete(cur, self._think_ahead if nxt is None else None)
        outputs += done
        if nxt is not None and not ok:  # scheduled on the failed step's rows: it fails too
            done, _ = self._complete(nxt, fail="the step before it failed")
            outputs += done
            nxt = None
        if nxt is None and self.cfg.async_scheduling:  # the device gets its next step now
            nxt = self._submit_next()
        self._ahead = nxt
        return outputs

    def _submit_next(self) -> _Submitted | None:
        """Schedule the next step once the last one's tokens are known, and submit it."""
        return self._schedule(self.step_count, ahead=False)

    def _go_ahead(self, cur: _Submitted) -> _Submitted | None:
        """Schedule and submit the step after ``cur`` while ``cur`` computes, where nothing
        about it waits for ``cur``'s tokens (see the module docstring). A switch due then is
        planned now too: its manifest counts ``cur``'s rows, which the workers write before
        the switch moves anything (both on the device's stream, in step order)."""
        if not self._can_go_ahead(cur):
            return None
        self.scheduler.advance(cur.batch)
        return self._schedule(cur.number + 1, ahead=True)

    def _schedule(self, number: int, ahead: bool) -> _Submitted | None:
        """Plan step ``number`` (its switch, its batch) and submit it; None when there is
        nothing to run. A step scheduled ahead never preempts."""
        switch = self.switches.prepare(number, self._step_ms_ema)
        precopy = self.switches.inflight is not None  # a pre-copy moves under this step
        batch = self.scheduler.schedule(
            allow_preemption=not ahead and switch is None and not precopy)
        if not batch.entries and switch is None and not precopy:
            return None
        plans = build_plans(self.scheduler, batch, switch, number, self.setup,
                            share_samples=self.cfg.async_scheduling)
        self._steps_ahead += ahead
        submitted = self._submit(number, batch, switch, precopy, plans)
        self.scheduler.register_switched()  # while the device computes
        return submitted

    def _can_go_ahead(self, cur: _Submitted) -> bool:
        if not self.cfg.async_scheduling or cur.batch.starved:
            return False
        # n samples fork off once their first tokens are known
        return not any(s and num_draws(req) > 1 for (req, _), s in zip(cur.batch.entries,
                                                                      cur.batch.samples))

    def _submit(self, number: int, batch: ScheduledBatch, switch: SwitchStep | None,
                precopy: bool, plans: list[StepPlan]) -> _Submitted:
        plans = self._profile.mark(plans)
        try:
            self.executor.submit(plans)
        except WorkerDiedError as e:
            self._fail_all(str(e))
            raise
        return _Submitted(number, batch, switch, precopy, plans, time.perf_counter())

    def _complete(self, cur: _Submitted, while_waiting: Callable[[], None] | None = None,
                  fail: str | None = None) -> tuple[list[RequestOutput], bool]:
        """Collect a submitted step and update its requests: (their outputs, whether the step
        succeeded). ``fail``: the step's requests finish with this error whatever it returns."""
        try:
            results = self.executor.collect(cur.plans, while_waiting)
        except StepFailedError as e:
            return self._fail_step(cur.batch, fail or str(e)), False
        except WorkerDiedError as e:
            self._fail_all(str(e))
            raise
        now = time.perf_counter()
        step_ms = (now - max(cur.t0, self._last_done)) * 1e3  # the device's time for it
        self._last_done = now
        if fail is not None:
            return self._fail_step(cur.batch, fail), False
        batch, switch = cur.batch, cur.switch
        self.switches.finish(switch, results, step_ms, cur.number, batch)
        if self.auto is not None:
            self.auto.observe(cur.number, batch, step_ms, cur.plans[0].layout,
                              switch is not None or cur.precopy)
        sampled = self.scheduler.update_from_output(batch, results[0], self.outputs)
        self._count_step(results, step_ms, len(sampled))
        heads: dict[str, Request] = {}  # one output per prompt: its n samples report together
        for req in sampled:
            head = req.group.members[0] if req.group is not None else req
            heads.setdefault(head.request_id, head)
        got = {id(m) for m in sampled}
        outputs = [self._output(head, got) for head in heads.values()]
        for out in outputs:  # finished requests leave the table (ids may be reused)
            if out.finished:
                self._forget(out.request_id)
        return outputs, True

    def profile_steps(self, steps: int, out_dir: str | os.PathLike) -> None:
        """Profile the next ``steps`` steps submitted on every worker; each writes where its
        time went to ``out_dir/profile_rank<r>.json`` when the step after them is submitted
        (or at shutdown) — `splash.engine.step_profile`."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise InvalidRequestError(f"steps must be an int >= 1, got {steps!r}")
        self._profile.start(steps, os.fspath(out_dir))

    def _drain(self) -> None:
        """Complete the step submitted ahead, if any (its outputs come with the next step)."""
        if self._ahead is not None:
            cur, self._ahead = self._ahead, None
            self._pending_outputs += self._complete(cur)[0]

    def _take_pending(self) -> list[RequestOutput]:
        """Outputs produced between steps (aborts); their requests leave the table."""
        outputs, self._pending_outputs = self._pending_outputs, []
        for out in outputs:
            self._forget(out.request_id)
        return outputs

    def _forget(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None:
            for member in req.group.members if req.group is not None else [req]:
                self.outputs.forget(member)

    def _think_ahead(self) -> None:
        """While the workers compute: the policy's answer for the next step (from the batch as
        it stands, one step old when used), off the step's critical path."""
        if self.auto is not None and self.switches.asks_policy(self.step_count + 1):
            self.auto.prepare(self.step_count + 1)

    def _fail_step(self, batch: ScheduledBatch, message: str) -> list[RequestOutput]:
        """The workers failed this step but kept their state: its requests finish with the
        error, the others serve on. The prefix cache is flushed (pages this step was writing
        may be registered already)."""
        reqs = [req for req, _ in batch.entries]
        logger.error("step %d failed (%s): its %d requests finish with the error; the engine "
                     "serves on", self.step_count, message, len(reqs))
        self.step_count += 1  # step numbers stay unique
        self.scheduler.prefix.clear()
        heads: dict[str, Request] = {}
        for req in reqs:
            if req.status is not Status.FINISHED:
                self.scheduler.finish(req, "error", message)
            head = req.group.members[0] if req.group is not None else req
            heads.setdefault(head.request_id, head)
        outputs = [self._output(head) for head in heads.values()]
        for out in outputs:
            if out.finished:
                self._forget(out.request_id)
        return outputs

    def _count_step(self, results: list[StepResult], step_ms: float, tokens: int) -> None:
        self._step_ms_ema = step_ms if self._step_ms_ema is None else (
            0.9 * self._step_ms_ema + 0.1 * step_ms)
        self.step_count += 1
        self._graph_steps += int(all(r.graph_replay for r in results))
        self._tokens_total += tokens

    def _output(self, req: Request, sampled: AbstractSet[int] = frozenset()) -> RequestOutput:
        """``req``'s prompt's output (all samples of its group); the requests whose ``id`` is
        in ``sampled`` report their last token as new."""
        members = req.group.members if req.group is not None else [req]
        return self.outputs.output(req, {m: m.output_token_ids[-1:] for m in members
                                         if id(m) in sampled})

    def _fail_all(self, message: str) -> None:
        """The worker group is gone: every in-flight request finishes with the error (the
        caller gets WorkerDiedError and fails its own clients)."""
        logger.error("worker failure: %s — failing all in-flight requests", message)
        self.healthy = False
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.scheduler.finish(req, "error", message)
        for rid in list(self.requests):
            self._forget(rid)

    # -- start-up -------------------------------------------------------------------------
    def warm_up(self, layouts: list[str] | None = None) -> float:
        """Compile the kernels before the first user request (`splash.engine.warmup`)."""
        return warm_up(self, layouts)

    def reset_counters(self) -> None:
        """Forget what ran so far (after the warm-up): counters, switch history, prefix cache."""
        sched = self.scheduler
        self.switches.forget_history()
        if self.auto is not None:
            self.auto.reset()
        sched.prefix.clear()
        sched.prefix.hit_tokens = sched.prefix.queried_tokens = 0
        sched.num_preemptions = sched.prompt_tokens_computed = 0
        self.step_count = self._tokens_total = self._graph_steps = self._steps_ahead = 0
        self._step_ms_ema = None
        self._started = time.monotonic()

    # -- weights --------------------------------------------------------------------------
    def update_weights(self, source: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
        """Load new weights of the same architecture in place: a checkpoint directory (every
        tensor) or a mapping of HF tensor names to tensors (only those; the rest keep their
        values). Only between rounds: with requests in flight this raises and changes nothing.
        Every rank copies its slices into the tensors it holds now (CUDA graphs stay valid);
        the prefix cache is flushed (its KV came from the old weights)."""
        in_flight = len(self.scheduler.running) + len(self.scheduler.waiting)
        if in_flight:
            raise InvalidRequestError(
                f"{in_flight} requests in flight: weights are updated between rollout rounds, "
                "when no request runs (let them finish or abort them first)")
        if self.switches.inflight is not None:
            raise InvalidRequestError("a layout switch is moving weights in the background: "
                                      "update the weights once it has completed")
        self._drain()
        t0 = time.perf_counter()
        names, payload = weights_to_update(self.cfg.model, self.model_cfg, source)
        self.executor.load_weights(payload, names, self.step_count)
        self.scheduler.prefix.clear()
        self.weight_version += 1
        ms = (time.perf_counter() - t0) * 1e3
        what = source if isinstance(source, (str, os.PathLike)) else f"{len(names)} tensors"
        logger.info("weights updated in place from %s (%d tensors, %.0f ms); prefix cache "
                    "flushed; weight version %d", what, len(names), ms, self.weight_version)
        return {"tensors": len(names), "ms": round(ms, 3), "weight_version": self.weight_version}

    # -- control and introspection ----------------------------------------------------------
    @property
    def step_ms_ema(self) -> float | None:
        """Moving average of the step time (ms), None before the first step."""
        return self._step_ms_ema

    def switch_layout(self, name: str, after_steps: int = 0) -> None:
        """Switch before the engine step ``after_steps`` steps from now (0: the next)."""
        if isinstance(after_steps, bool) or not isinstance(after_steps, int) or after_steps < 0:
            raise InvalidRequestError(f"after_steps must be an int >= 0, got {after_steps!r}")
        if after_steps:  # counted from the next step not scheduled yet
            self.switches.force_at(self.step_count + (self._ahead is not None) + after_steps,
                                   name)
        else:
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
            "policy_decisions": self.auto.decisions[-50:] if self.auto else [],
            # switches made and declined: predicted gain and cost, realized gain of switches
            "policy_audit": list(self.auto.audit.entries) if self.auto else [],
            "cost_model_source": self.setup.profile.source,
            "kv_capacity_tokens": self.setup.kv_capacity_tokens(),
            "kv_pages_used": self.allocators.used(),
            "kv_pages_total": self.setup.num_pages,
            "page_size": self.setup.page_size,
            "num_waiting": len(self.scheduler.waiting),
            "num_running": len(self.scheduler.running),
            "num_steps": self.step_count,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_caching": self.scheduler.prefix.enabled,
            "prefix_cache_hit_tokens": self.scheduler.prefix.hit_tokens,
            "prefix_cache_queried_tokens": self.scheduler.prefix.queried_tokens,
            "prefix_cache_pages": [a.num_cached for a in self.allocators.ranks],
            "prompt_tokens_computed": self.scheduler.prompt_tokens_computed,
            "weight_version": self.weight_version,
            "cuda_graphs": self.setup.cuda_graphs,
            **self._graphs_at_start,  # captured at start-up: count, seconds, MiB per rank
            "memory": self.setup.budget.as_dict(),  # how the KV pool was sized (GiB per rank)
            "graph_steps": self._graph_steps,  # steps replayed from CUDA graphs
            "async_scheduling": self.cfg.async_scheduling,
            "steps_scheduled_ahead": self._steps_ahead,  # before the step before them was done
            "step_time_ms_ema": self._step_ms_ema,
            "tokens_generated": self._tokens_total,
            "tokens_per_s": self._tokens_total / elapsed,
            "worker_pids": list(self.executor.pids),
            "healthy": self.healthy,
            "backend": self.setup.backend_name,
            "tp_size": self.world,
        }

    def shutdown(self) -> None:
        if self.healthy and self._ahead is not None:
            try:  # the step submitted ahead finishes first: no rank leaves a peer waiting
                self._drain()  # in one of its collectives
            except Exception as e:  # a dead worker: the executor's shutdown handles it
                logger.warning("shutdown: the step in flight did not complete (%s)", e)
        gc.unfreeze()  # what this engine built may be collected again: the in-process
        self.executor.shutdown()  # executor's collection frees its device memory
