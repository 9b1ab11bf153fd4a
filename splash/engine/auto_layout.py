"""layout="auto": ask the policy every step which layout the next step should run in.

The engine's batch is summarised as the cost model's BatchShape (decode rows with their
contexts, prefill chunks with their prefixes); waiting prompts are passed for layout-aware
admission. Every decision and its reason is kept for stats() and logged when it switches.
"""

from __future__ import annotations

import statistics
from typing import Any

from splash.core.ownership import LAYOUTS
from splash.engine.scheduler import Scheduler
from splash.engine.setup import EngineSetup
from splash.logging_utils import get_logger
from splash.planning.cost_model import BatchShape
from splash.planning.policy import build_policy

logger = get_logger("splash.policy")


class AutoLayout:
    """The policy of one engine, reading the ``scheduler``'s batch: ``auto(step)`` is the layout
    to switch to before ``step``, or None."""

    def __init__(self, setup: EngineSetup, scheduler: Scheduler, margin: float,
                 min_dwell_steps: int = 4) -> None:
        mem = setup.memory
        # the budget that reproduces this engine's pool: static state + the physical pages
        budget = mem.static_bytes_per_rank(LAYOUTS["dop"]) + setup.num_pages * mem.page_bytes
        self.scheduler = scheduler
        self.decisions: list[dict[str, Any]] = []  # the latest 200, with their reasons
        self.policy = build_policy(setup.model_cfg, setup.world, setup.profile, budget,
                                   weight_dtype=mem.weight_dtype, kv_dtype=mem.kv_dtype,
                                   page_size=setup.page_size, margin=margin,
                                   min_dwell_steps=min_dwell_steps,
                                   sparse_attention=False)  # the engine runs dense MLA

    def __call__(self, step: int) -> str | None:
        sched = self.scheduler
        current = sched.layout.name
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
        self.decisions.append({"step": step, "layout": decision.layout,
                               "switch": decision.switch, "reason": decision.reason})
        del self.decisions[:-200]
        if decision.switch:
            logger.info("policy: %s -> %s at step %d: %s", current, decision.layout, step,
                        decision.reason)
            return decision.layout
        return None
