"""Transition-aware layout policy (paper §4.2).

Every feasible layout is scored on the current batch. The policy switches only when the best
leads the current by ``margin`` (hysteresis near a crossover), the current layout has been held
for ``min_dwell_steps`` decisions, the predicted gain over the expected remaining steps outlasts
the predicted switch cost, and the switch fits the one-layer headroom. An infeasible current
layout overrides margin and dwell. Leads are smoothed over decisions (``smoothing``: weight of
the newest), so one odd step — a lone prefill chunk among decode rows — does not flip the layout.

Beyond the paper, admission is layout-aware: when requests wait for KV room, each layout is
scored by rows per millisecond *including the waiting requests it could admit*, so a layout with
more room (DOP) can win even at a slower step.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from splash.core.memory import MemoryModel
from splash.core.ownership import LAYOUT_NAMES, fitting_layouts, get_layout
from splash.planning.cost_model import BatchShape, CostModel
from splash.planning.feasibility import Feasibility

CostFn = Callable[[str, BatchShape], float]
# (src, dst, batch, live tokens per request, their owners or None) -> ms
SwitchCostFn = Callable[[str, str, BatchShape, np.ndarray, Sequence[int] | None], float]


@dataclass(frozen=True)
class Decision:
    """What to run the next step in, and why."""

    layout: str  # layout of the next step
    switch: bool  # True when ``layout`` differs from the current one
    reason: str  # human-readable justification
    predicted_ms: dict[str, float]  # step time per feasible layout (incl. admitted requests)
    switch_cost_ms: float = 0.0  # predicted live-switch overhead (0 when staying)
    admitted: dict[str, int] = field(default_factory=dict)  # waiting requests each could admit
    # what was weighed: the best other layout (None when the current one was best), its
    # predicted gain in ms per step at this step's work, and the cost of switching to it
    candidate: str | None = None
    gain_ms: float = 0.0
    candidate_cost_ms: float = 0.0
    kind: str = "stay"  # stay | switch | margin | dwell | economics | headroom | forced | hold


class LayoutPolicy:
    """Chooses the layout of each step. Build one with `build_policy` from a ModelConfig.

    ``cost_fn`` / ``switch_cost_fn`` replace the cost model's predictions (tests, measured
    tables). ``reserve_bytes`` is scratch + graphs + reserve per rank.
    """

    def __init__(self, cost_model: CostModel, memory_model: MemoryModel | None,
                 budget_bytes: int, margin: float = 0.1, min_dwell_steps: int = 16,
                 reserve_bytes: int = 0, layouts: Sequence[str] | None = None,
                 cost_fn: CostFn | None = None, switch_cost_fn: SwitchCostFn | None = None,
                 history_len: int = 512, max_admission_probe: int = 64,
                 smoothing: float = 0.5) -> None:
        if not 0 <= margin < 1:
            raise ValueError("margin must lie in [0, 1)")
        if not 0 < smoothing <= 1:
            raise ValueError("smoothing (weight of the newest score) must lie in (0, 1]")
        if min_dwell_steps < 0 or budget_bytes <= 0:
            raise ValueError("min_dwell_steps must be >= 0 and budget_bytes > 0")
        self.cost_model = cost_model
        memory = memory_model or cost_model.memory
        aux = cost_model.kv_bytes_per_token_per_layer - memory.kv_bytes_per_token_per_layer
        self.feasibility = Feasibility(memory, reserve_bytes, aux)
        self.budget_bytes = int(budget_bytes)
        self.margin = margin
        self.min_dwell_steps = min_dwell_steps
        fit = fitting_layouts(memory.cfg.num_attention_heads, memory.world)
        self.layouts = [n for n in (layouts or LAYOUT_NAMES) if get_layout(n).name in fit]
        if not self.layouts:
            raise ValueError(f"no candidate layout fits {memory.world} ranks")
        self.cost_fn = cost_fn or cost_model.step_time_ms
        self.switch_cost_fn = switch_cost_fn or cost_model.switch_cost_ms
        self.max_admission_probe = max_admission_probe
        self.smoothing = smoothing
        self._ema: dict[str, float] = {}  # smoothed speed relative to the current layout
        self.history: deque[Decision] = deque(maxlen=history_len)
        self._since_switch = min_dwell_steps  # the first decision may switch at once

    # -- the decision ----------------------------------------------------------------------
    def decide(self, current: str, batch: BatchShape, expected_remaining_steps: float,
               waiting_prompt_lens: Sequence[int] = (),
               candidate_batches: Mapping[str, BatchShape] | None = None,
               live_tokens: Sequence[int] | None = None,
               live_owners: Sequence[int] | None = None) -> Decision:
        """Layout of the next step for ``batch`` (this step's work, live requests' contexts).

        ``expected_remaining_steps``: steps the current mix is expected to last (the gain
        horizon). ``waiting_prompt_lens``: prompts queued for KV room, in admission order.
        ``candidate_batches``: the step the scheduler would build under another layout (owned
        layouts share the prefill budget among owners); a layout missing there uses ``batch``.
        Layouts are compared by rows per millisecond, so compositions may differ.
        ``live_tokens``: KV tokens held (or reserved) by *every* live request, scheduled in this
        step or not (default: ``batch``'s); ``live_owners``: their owners under the current
        layout when it is owned (DP <-> DOP keep owners; other switches place them greedily).
        """
        self._since_switch += 1
        owners: Sequence[int] | None
        if live_tokens is None:
            tokens, owners = batch.tokens_after(), batch.owners
        else:
            tokens, owners = np.asarray(live_tokens, dtype=np.int64), live_owners
        if not get_layout(current).uses_owners:
            owners = None
        cands = {n: (candidate_batches or {}).get(n, batch) for n in self.layouts}
        feas = {n: self._fits(n, tokens, owners) for n in self.layouts}
        ok = [n for n in self.layouts if feas[n]]
        times, rows, admitted = {}, {}, {}
        for n in ok:
            b, k = self._with_admissions(n, cands[n], tokens, waiting_prompt_lens)
            times[n], rows[n], admitted[n] = self.cost_fn(n, b), b.num_rows, k
        if not ok:
            return self._record(Decision(current, False, "no layout fits the memory budget: "
                                         "hold admission", times, 0.0, admitted, kind="hold"))

        def switch_ms(dst: str) -> float:
            return self.switch_cost_fn(current, dst, batch, tokens, owners)

        def switch_fits(dst: str) -> bool:
            own = owners if get_layout(dst).uses_owners else None
            f = self.feasibility
            if not feas.get(current, False):  # the source is resident already: dst + buffer
                need = f.per_rank_bytes(dst, tokens, own) + f.switch_buffer_bytes(
                    current, dst, tokens, own)
                return need <= self.budget_bytes
            return f.switch_feasible(current, dst, tokens, self.budget_bytes, own)

        raw = {n: rows[n] / max(times[n], 1e-9) for n in ok}  # rows per ms
        if not feas.get(current, False):  # forced: margin, dwell and smoothing do not apply
            self._ema.clear()
            for cand in sorted(ok, key=lambda n: -raw[n]):
                if switch_fits(cand):
                    return self._switch(current, cand, f"{current} no longer fits the budget; "
                                        f"{_describe(cand, times, admitted)}", times, admitted,
                                        switch_ms(cand), 0.0, "forced")
            return self._record(Decision(current, False, f"{current} no longer fits and no "
                                         "switch fits the headroom: hold admission", times, 0.0,
                                         admitted, kind="hold"))
        for n in set(self._ema) - set(ok):  # a layout that stopped fitting starts afresh
            del self._ema[n]
        rel = {n: self._smooth(n, raw[n] / raw[current]) for n in ok}  # speed vs current
        best = max(ok, key=lambda n: (rel[n], n == current))
        if best == current:
            return self._record(Decision(current, False, f"{current} is best "
                                         f"({_describe(current, times, admitted)})", times, 0.0,
                                         admitted))
        cost = switch_ms(best)
        lead = 1.0 - 1.0 / rel[best]
        gain = times[current] * lead  # ms per step the best layout saves at this step's work

        def decline(kind: str, why: str) -> Decision:
            return self._record(Decision(current, False, why, times, 0.0, admitted, best, gain,
                                         cost, kind))

        versus = (f"{_describe(best, times, admitted)} vs {_describe(current, times, admitted)} "
                  f"(-{lead:.0%})")
        if lead <= self.margin:
            return decline("margin", f"{versus} within margin {self.margin:.0%}")
        if self._since_switch <= self.min_dwell_steps:
            return decline("dwell", f"{versus}; dwell {self._since_switch}"
                                    f"/{self.min_dwell_steps} steps")
        # the current step's work at the best layout's (smoothed) rate: ms saved per step
        horizon = gain * max(expected_remaining_steps, 0.0)
        economics = (f"gain {horizon:.1f} ms over {expected_remaining_steps:.0f} steps "
                     f"{'>' if horizon > cost else '<='} switch {cost:.1f} ms")
        if horizon <= cost:
            return decline("economics", f"{versus}; {economics}: stay")
        if not switch_fits(best):
            return decline("headroom", f"{versus}; switch deferred: one layer of headroom does "
                                       "not fit")
        return self._switch(current, best, f"{versus} > margin {self.margin:.0%}; {economics}",
                            times, admitted, cost, gain)

    # -- helpers ---------------------------------------------------------------------------
    def _smooth(self, name: str, score: float) -> float:
        """Exponential average of a layout's speed relative to the current layout, so one
        unusual step (a lone prefill chunk) does not flip the layout; ``smoothing`` 1.0 uses
        the current step alone. Cleared on every switch (the reference changes)."""
        prev = self._ema.get(name)
        value = score if prev is None else self.smoothing * score + (1 - self.smoothing) * prev
        self._ema[name] = value
        return value

    def _fits(self, name: str, tokens: np.ndarray, owners: Sequence[int] | None) -> bool:
        own = owners if get_layout(name).uses_owners else None  # None: placed greedily
        return self.feasibility.feasible(name, tokens, self.budget_bytes, own)

    def _with_admissions(self, name: str, batch: BatchShape, tokens: np.ndarray,
                         waiting: Sequence[int]) -> tuple[BatchShape, int]:
        """``batch`` plus, as decode rows, the longest prefix of ``waiting`` that fits."""
        waiting = list(waiting)[: self.max_admission_probe]
        if not waiting:
            return batch, 0
        lo, hi = 0, len(waiting)  # largest k whose admission stays feasible (binary search)
        while lo < hi:
            k = (lo + hi + 1) // 2
            extra = np.concatenate([tokens, np.asarray(waiting[:k], dtype=np.int64)])
            if self.feasibility.feasible(name, extra, self.budget_bytes):
                lo = k
            else:
                hi = k - 1
        if lo == 0:
            return batch, 0
        admitted = tuple(batch.decode_ctx) + tuple(int(p) for p in waiting[:lo])
        return BatchShape(admitted, batch.prefill, None), lo  # admissions rebalance owners

    def _switch(self, src: str, dst: str, reason: str, times: dict[str, float],
                admitted: dict[str, int], cost: float, gain: float,
                kind: str = "switch") -> Decision:
        self._since_switch = 0
        self._ema.clear()
        return self._record(Decision(dst, True, reason, times, cost, admitted, dst, gain, cost,
                                     kind))

    def _record(self, decision: Decision) -> Decision:
        self.history.append(decision)
        return decision

    def reset(self) -> None:
        """Forget history, smoothed scores and dwell (a new run)."""
        self.history.clear()
        self._ema.clear()
        self._since_switch = self.min_dwell_steps

    def stats(self) -> dict:
        """Counts over the bounded history: decisions, switches, chosen layouts."""
        hist = list(self.history)
        return {"decisions": len(hist), "switches": sum(d.switch for d in hist),
                "chosen": dict(Counter(d.layout for d in hist)),
                "last_reason": hist[-1].reason if hist else None}


def _describe(name: str, times: dict[str, float], admitted: dict[str, int]) -> str:
    if any(admitted.values()):  # scores are rows per ms once admissions differ
        return f"{name} predicted {times[name]:.2f} ms admitting {admitted[name]} waiting"
    return f"{name} predicted {times[name]:.2f} ms"


def build_policy(cfg, world: int, profile, budget_bytes: int, *, weight_dtype: str = "bf16",
                 kv_dtype: str = "bf16", page_size: int = 64, reserve_bytes: int = 0,
                 margin: float = 0.1, min_dwell_steps: int = 16,
                 sparse_attention: bool | None = None, smoothing: float = 0.5,
                 resident_heads: bool = False) -> LayoutPolicy:
    """The policy the engine uses: cost model + memory accounting of ``cfg`` on ``world`` ranks
    of hardware ``profile`` (a HardwareProfile), ``budget_bytes`` of device memory per rank.
    An engine that runs dense MLA on a DSA model passes ``sparse_attention=False``; one whose
    ranks hold every layout's projection heads, ``resident_heads=True`` (no weight moves)."""
    cm = CostModel(cfg, world, profile, weight_dtype, kv_dtype, page_size, sparse_attention,
                   resident_heads)
    return LayoutPolicy(cm, cm.memory, budget_bytes, margin=margin,
                        min_dwell_steps=min_dwell_steps, reserve_bytes=reserve_bytes,
                        smoothing=smoothing)
