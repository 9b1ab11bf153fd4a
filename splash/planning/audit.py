"""The policy's decisions held against what happened.

Every switch the policy makes, and every switch it considers and declines (a faster layout
within the margin, during the dwell, not worth its cost, or without headroom), becomes an
entry with its predicted gain (ms per step at the step's work) and predicted switch cost. A
run of identical declines is one entry with a count.

After a switch from A to B, the *realized* gain is measured from step times: the steps served
in A just before the decision give A's measured-to-predicted ratio ``f``; on each of the first
``window`` steps served in B (the switch's own step excluded), staying would have cost
``f * predicted_A(batch)``, so the realized gain per step is the median of that minus the
measured time in B. When no step ran in A before the decision (an idle engine choosing for the
load about to arrive), ``f`` is 1: staying is the cost model's prediction alone
(``stay_basis`` says which). A declined switch has no realized gain (what would have happened
is not observed).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from splash.core.shapes import BatchShape

CostFn = Callable[[str, BatchShape], float]


@dataclass(frozen=True)
class Observation:
    step: int
    layout: str
    batch: BatchShape
    ms: float


class DecisionAudit:
    """Entries (dicts) for switches and declined switches; ``observe`` every step served."""

    def __init__(self, cost_fn: CostFn, window: int = 8, max_entries: int = 500) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self.cost_fn, self.window, self.max_entries = cost_fn, window, max_entries
        self.entries: list[dict[str, Any]] = []
        self._recent: deque[Observation] = deque(maxlen=4 * window)
        self._open: list[tuple[dict[str, Any], list[Observation], list[Observation]]] = []

    def record(self, step: int, current: str, decision: Any, horizon_steps: float
               ) -> dict[str, Any] | None:
        """Add ``decision`` (a policy Decision) when it switches or declines a candidate; the
        entry, or None when the current layout was simply best. A decline identical to the
        previous entry (same layouts and reason kind) only bumps that entry's count."""
        candidate = decision.layout if decision.switch else decision.candidate
        if candidate is None or candidate == current:
            return None
        entry: dict[str, Any] = {
            "step": step, "from": current, "to": candidate, "switched": bool(decision.switch),
            "kind": decision.kind, "reason": decision.reason,
            "predicted_step_ms": _r(decision.predicted_ms.get(current)),
            "predicted_gain_ms": _r(decision.gain_ms),
            "predicted_switch_ms": _r(decision.candidate_cost_ms),
            "horizon_steps": _r(horizon_steps)}
        last = self.entries[-1] if self.entries else None
        if not decision.switch and last is not None and not last["switched"] and \
                (last["from"], last["to"], last["kind"]) == (current, candidate, decision.kind):
            last["count"] += 1
            last["last_step"] = step
            last["predicted_gain_ms"] = max(last["predicted_gain_ms"], entry["predicted_gain_ms"])
            return None
        entry["count"], entry["last_step"] = 1, step
        if decision.switch:
            entry.update(realized_gain_ms=None, realized_steps=0)
            before = [o for o in self._recent if o.layout == current][-self.window:]
            self._open.append((entry, before, []))
        self.entries.append(entry)
        del self.entries[:-self.max_entries]
        return entry

    def observe(self, step: int, layout: str, batch: BatchShape, ms: float,
                switching: bool = False) -> list[dict[str, Any]]:
        """One served step (``switching``: it carried switch work, so it measures neither
        layout). Returns the switch entries whose realized gain this step completed."""
        done = []
        obs = Observation(step, layout, batch, ms)
        for item in list(self._open):
            entry, before, after = item
            if not switching and layout == entry["to"] and step > entry["step"]:
                after.append(obs)
            left = after and layout != entry["to"]  # switched away before the window filled
            stale = not after and step - entry["step"] > 64 * self.window  # never arrived
            if len(after) >= self.window or left or stale:
                self._open.remove(item)
                self._realize(entry, before, after)
                done.append(entry)
        if not switching and batch.num_rows:
            self._recent.append(obs)
        return done

    def _realize(self, entry: dict[str, Any], before: list[Observation],
                 after: list[Observation]) -> None:
        src = entry["from"]
        if not after:
            entry["realized_note"] = "no step was served in the destination layout"
            return
        f = 1.0
        if before:
            predicted_before = sum(self.cost_fn(src, o.batch) for o in before)
            f = sum(o.ms for o in before) / max(predicted_before, 1e-12)
        entry["stay_basis"] = "measured" if before else "model"
        stay = [f * self.cost_fn(src, o.batch) for o in after]
        gains = [s - o.ms for s, o in zip(stay, after)]
        entry.update(realized_gain_ms=_r(statistics.median(gains)), realized_steps=len(after),
                     measured_step_ms_after=_r(statistics.median(o.ms for o in after)),
                     estimated_stay_ms=_r(statistics.median(stay)),
                     measured_over_predicted_before=_r(f))


def _r(x: float | None) -> float | None:
    return None if x is None else round(float(x), 4)
