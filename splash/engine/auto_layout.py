"""layout="auto": ask the policy which layout the next step should run in (when the batch
changed, and at least every few steps). The engine asks while the workers compute the step
before (`prepare`), so the answer costs the step no host time; it reads the batch one step old.

The engine's batch is summarised as the cost model's BatchShape (decode rows with their
contexts, prefill chunks with their prefixes); waiting prompts are passed for layout-aware
admission. Every decision and its reason is kept for stats(); switches are logged at INFO,
declined switches (a faster layout the policy did not take, and why) at DEBUG. The audit
(`splash.planning.audit`) holds switches and declines with their predicted gain and cost, and
measures each switch's realized gain from the step times around it.
"""

from __future__ import annotations

import statistics
from typing import Any

from splash.core.ownership import LAYOUTS, get_layout
from splash.engine.scheduler import ScheduledBatch, Scheduler
from splash.engine.setup import EngineSetup
from splash.logging_utils import get_logger
from splash.planning.audit import DecisionAudit
from splash.planning.cost_model import BatchShape
from splash.planning.policy import build_policy

logger = get_logger("splash.policy")


class AutoLayout:
    """The policy of one engine, reading the ``scheduler``'s batch: ``auto(step)`` is the layout
    to switch to before ``step``, or None."""

    def __init__(self, setup: EngineSetup, scheduler: Scheduler, margin: float,
                 min_dwell_steps: int = 4, decide_every: int = 8) -> None:
        mem = setup.memory
        # the budget that reproduces this engine's pool: static state + the physical pages
        budget = mem.static_bytes_per_rank(LAYOUTS["dop"]) + setup.num_pages * mem.page_bytes
        self.scheduler = scheduler
        self.decisions: list[dict[str, Any]] = []  # the latest 200, with their reasons
        self.policy = build_policy(setup.model_cfg, setup.world, setup.profile, budget,
                                   weight_dtype=mem.weight_dtype, kv_dtype=mem.kv_dtype,
                                   page_size=setup.page_size, margin=margin,
                                   min_dwell_steps=min_dwell_steps,
                                   resident_heads=setup.resident_heads)  # DSA models: sparse,
        #   as the engine runs them (indexer, top-k, sparse MLA)
        self.audit = DecisionAudit(self.policy.cost_fn)
        self._pending: str | None = None  # a switch decided and not yet in place (pre-copy)
        # the policy is asked when the batch changes (arrivals, finishes, prefills) and at least
        # every ``decide_every`` steps: a steady decode batch changes only by its contexts'
        # slow growth, and a decision costs host time on every step it is made
        self.decide_every = decide_every
        self._asked: tuple[tuple, int] | None = None  # (batch signature, step) of the last ask
        self._prepared: tuple[int, str | None] | None = None  # (step, answer) asked ahead
        logger.info("layout policy: cost model on profile %s (source %s), margin %.0f%%",
                    setup.profile.name, setup.profile.source, 100 * margin)

    def reset(self) -> None:
        """Forget every decision, the audit and the policy's smoothing and dwell."""
        self.decisions.clear()
        self.audit = DecisionAudit(self.policy.cost_fn)
        self._pending = None
        self._asked = self._prepared = None
        self.policy.reset()

    def prepare(self, step: int) -> None:
        """Ask now (while the step before ``step`` computes) for ``step``'s answer, kept for
        the call at ``step`` (asked once per step)."""
        if self._prepared is not None and self._prepared[0] == step:
            return
        self._prepared = None  # an ask that fails leaves no stale answer behind
        self._prepared = (step, self._ask(step))

    def __call__(self, step: int) -> str | None:
        prepared, self._prepared = self._prepared, None
        if prepared is not None and prepared[0] == step:
            return prepared[1]
        return self._ask(step)

    def _ask(self, step: int) -> str | None:
        sched = self.scheduler
        current = sched.layout.name
        sig = (current, len(sched.running), len(sched.waiting),
               any(r.num_pending > 1 for r in sched.running))
        if self._asked is not None and self._asked[0] == sig and \
                step - self._asked[1] < self.decide_every:
            return None
        self._asked = (sig, step)
        running = list(sched.running)
        budget = sched.cfg.max_num_batched_tokens
        decode = [r.num_computed + 1 for r in running if r.num_pending <= 1]
        prefill = [(min(r.num_pending, budget), r.num_computed)
                   for r in running if r.num_pending > 1]
        if not running:  # an idle engine picks the layout for the load about to arrive
            for r in sched.waiting:
                if budget <= 0:
                    break
                prefill.append((min(len(r.prompt_token_ids), budget), 0))
                budget -= prefill[-1][0]
            running = list(sched.waiting)[: len(prefill)]
        if not decode and not prefill:
            return None
        batch = BatchShape(decode_ctx=tuple(decode), prefill=tuple(prefill))
        remaining = [max(r.params.max_tokens - len(r.output_token_ids), 1) for r in running]
        decision = self.policy.decide(
            current, batch, float(statistics.median(remaining)),
            waiting_prompt_lens=[len(r.prompt_token_ids) for r in sched.waiting],
            live_tokens=[r.num_computed for r in running],
            live_owners=[r.owner for r in running])
        horizon = float(statistics.median(remaining))
        if self._pending == current:
            self._pending = None
        entry = None
        if decision.switch or decision.candidate != self._pending:  # not the switch under way
            entry = self.audit.record(step, current, decision, horizon)
        record = entry if entry is not None and decision.switch else {
            "step": step, "layout": decision.layout, "switch": decision.switch,
            "reason": decision.reason}
        record.update(layout=decision.layout, switch=decision.switch)
        self.decisions.append(record)
        del self.decisions[:-200]
        if decision.switch:
            self._pending = decision.layout
            logger.info("policy: %s -> %s at step %d: %s (predicted gain %.2f ms/step, switch "
                        "%.2f ms)", current, decision.layout, step, decision.reason,
                        decision.gain_ms, decision.candidate_cost_ms)
            return decision.layout
        if entry is not None:
            logger.debug("policy: stays in %s at step %d, declining %s (%s): %s", current, step,
                         entry["to"], entry["kind"], decision.reason)
        return None

    def observe(self, step: int, batch: ScheduledBatch, step_ms: float, layout: str,
                switching: bool) -> None:
        """A served step, for the audit: its work as a BatchShape and its measured time."""
        decode, prefill, dec_own, pf_own = [], [], [], []
        for (req, n), start, sample in zip(batch.entries, batch.starts, batch.samples):
            if n == 1 and sample:
                decode.append(start + 1)
                dec_own.append(req.owner)
            else:
                prefill.append((n, start))
                pf_own.append(req.owner)
        if not decode and not prefill:
            return
        owners = dec_own + pf_own if get_layout(layout).uses_owners else None
        shape = BatchShape(tuple(decode), tuple(prefill), owners)
        for e in self.audit.observe(step, layout, shape, step_ms, switching):
            if e.get("realized_gain_ms") is None:
                continue
            logger.info("policy audit: %s -> %s at step %d realized %.2f ms/step over %d steps "
                        "(predicted %.2f)", e["from"], e["to"], e["step"], e["realized_gain_ms"],
                        e["realized_steps"], e["predicted_gain_ms"])
