"""Discrete-event simulation of serving a trace in a fixed layout or under the policy (`auto`).

Continuous batching: each step carries every decoding request (one row each) and fills the rest
of a token budget with prefill chunks (under owned layouts the budget is shared among owners, as
DP-attention schedulers do). Requests are admitted while the current layout's KV room holds their
prompt (plus a page of watermark per running request); when decode growth overflows, the newest
request is preempted and recomputed. A step costs the cost model's prediction; under `auto` the
policy decides every ``decide_every`` steps and a switch adds its live cost. Runs of pure decode
steps with nothing else changing are simulated ``max_leap`` at a time, so paper-scale traces
take seconds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from splash.core.ownership import assign_owners, get_layout, least_loaded
from splash.errors import LayoutInfeasibleError
from splash.planning import workloads
from splash.planning.cost_model import BatchShape, CostModel
from splash.planning.feasibility import default_reserve_bytes
from splash.planning.policy import LayoutPolicy

GIB = 1 << 30


@dataclass(frozen=True)
class SimConfig:
    max_num_batched_tokens: int = 8192  # rows per step (the prefill chunk budget)
    max_num_seqs: int = 256  # running requests
    memory_fraction: float = 0.85  # of the profile's device memory, per rank
    page_size: int = 64
    weight_dtype: str = "fp8"
    kv_dtype: str = "fp8"
    reserve_bytes: int | None = None  # None: default_reserve_bytes for the token budget
    decide_every: int = 8  # steps between policy decisions under auto
    margin: float = 0.05
    smoothing: float = 0.25  # weight of the newest step in the policy's smoothed scores
    min_dwell_decisions: int = 4
    max_leap: int = 64  # decode steps simulated at once
    initial_layout: str = "tp"  # where auto starts
    sparse_attention: bool | None = None

    def __post_init__(self) -> None:
        if min(self.max_num_batched_tokens, self.max_num_seqs, self.page_size,
               self.decide_every, self.max_leap) < 1:
            raise ValueError("token budget, seqs, page size, decide_every, max_leap must be >= 1")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError("memory_fraction must lie in (0, 1]")
        get_layout(self.initial_layout)


class _Req:
    __slots__ = ("prompt", "output", "arrival_ms", "target", "computed", "generated", "owner",
                 "first_ms", "finish_ms", "seq")

    def __init__(self, prompt: int, output: int, arrival_s: float) -> None:
        self.prompt, self.output, self.arrival_ms = prompt, output, arrival_s * 1e3
        self.target = prompt  # tokens to prefill (prompt + generated after a preemption)
        self.computed = self.generated = 0
        self.owner, self.seq = 0, 0
        self.first_ms: float | None = None
        self.finish_ms: float | None = None


def build_models(cfg, profile, tp: int, sim: SimConfig) -> tuple[CostModel, LayoutPolicy]:
    cm = CostModel(cfg, tp, profile, sim.weight_dtype, sim.kv_dtype, sim.page_size,
                   sim.sparse_attention)
    budget = int(sim.memory_fraction * profile.memory_gib * GIB)
    reserve = sim.reserve_bytes
    if reserve is None:
        reserve = default_reserve_bytes(cfg, tp, sim.max_num_batched_tokens)
    policy = LayoutPolicy(cm, cm.memory, budget, margin=sim.margin,
                          min_dwell_steps=sim.min_dwell_decisions, reserve_bytes=reserve,
                          smoothing=sim.smoothing)
    return cm, policy


def simulate(trace: Sequence, cfg, profile, tp: int, layout: str = "auto",
             sim: SimConfig | None = None, models: tuple | None = None) -> dict:
    """Serve ``trace`` (TraceRequest-like: prompt_len, output_len, arrival_s); return metrics:
    throughput, TTFT/TPOT percentiles, switches and the layout timeline."""
    sim = sim or SimConfig()
    cm, policy = models or build_models(cfg, profile, tp, sim)
    feas, budget, T = policy.feasibility, policy.budget_bytes, tp
    auto = layout == "auto"
    if not auto and get_layout(layout).name not in policy.layouts:
        raise LayoutInfeasibleError(f"layout {layout}: {cfg.num_attention_heads} heads do not "
                                    f"split over {tp} ranks")
    cur = get_layout(layout).name if not auto else (
        sim.initial_layout if sim.initial_layout in policy.layouts else policy.layouts[0])
    reqs = [_Req(r.prompt_len, r.output_len, r.arrival_s) for r in trace]
    pending = deque(sorted(reqs, key=lambda r: r.arrival_ms))
    waiting: deque[_Req] = deque()
    running: list[_Req] = []
    t = 0.0
    steps = preemptions = seq = 0
    last_decide = -sim.decide_every
    timeline = [{"t_s": 0.0, "step": 0, "layout": cur}]
    switches: list[dict] = []

    def owned() -> bool:
        return get_layout(cur).uses_owners

    def fits(extra: Sequence[int] = (), extra_owner: int | None = None, grow: int = 0) -> bool:
        toks = [max(r.computed, r.target) + grow for r in running] + list(extra)
        owners = None
        if owned():
            owners = [r.owner for r in running] + ([extra_owner] if extra else [])
        return feas.feasible(cur, toks, budget, owners)

    while pending or waiting or running:
        while pending and pending[0].arrival_ms <= t:
            waiting.append(pending.popleft())
        if not running and not waiting:
            t = pending[0].arrival_ms
            continue
        blocked_by_kv = False  # admission: FCFS while KV room (with watermark) holds the prompt
        while waiting and len(running) < sim.max_num_seqs:
            r = waiting[0]
            owner = 0
            if owned():  # the engine's admission rule
                load, count = [0] * T, [0] * T
                for x in running:
                    load[x.owner] += x.target
                    count[x.owner] += 1
                owner = least_loaded(load, count) or 0
            if not fits([r.target + sim.page_size], owner, grow=sim.page_size if running else 0):
                blocked_by_kv = True
                break
            waiting.popleft()
            r.owner, r.seq, seq = owner, seq, seq + 1
            running.append(r)
        while running and not fits(grow=1):  # decode growth overflow: preempt the newest
            victim = max(running, key=lambda x: x.seq)
            running.remove(victim)
            victim.target, victim.computed = victim.prompt + victim.generated, 0
            waiting.appendleft(victim)
            preemptions += 1
        if not running:
            if waiting and not pending:
                raise RuntimeError(f"a request of {waiting[0].target} tokens fits no KV room in "
                                   f"layout {cur}")
            t = pending[0].arrival_ms if pending else t
            continue
        dec, chunks, batch = _schedule(running, sim.max_num_batched_tokens,
                                       [r.owner for r in running] if owned() else None)
        if auto and steps - last_decide >= sim.decide_every:
            last_decide = steps
            live = [max(r.computed, r.target) + 1 for r in running]  # held or reserved
            greedy = None  # owners a switch into an owned layout would place
            if not owned():
                greedy = [int(o) for o in assign_owners(live, T)]
            cands = {n: _schedule(running, sim.max_num_batched_tokens,
                                  (greedy or [r.owner for r in running])
                                  if get_layout(n).uses_owners else None)[2]
                     for n in policy.layouts if n != cur}
            horizon = float(np.mean([max(r.generated, 32) for r in running]))
            wait_lens = [w.target for w in list(waiting)[:64]] if blocked_by_kv else ()
            d = policy.decide(cur, batch, horizon, wait_lens, cands, live,
                              [r.owner for r in running] if owned() else None)
            if d.switch:
                src, cur = cur, d.layout
                if owned() and greedy is not None:  # the switch's collectives place owners
                    for r, o in zip(running, greedy):
                        r.owner = o
                t += d.switch_cost_ms
                switches.append({"step": steps, "t_s": t / 1e3, "from": src, "to": cur,
                                 "cost_ms": d.switch_cost_ms, "reason": d.reason})
                timeline.append({"t_s": t / 1e3, "step": steps, "layout": cur})
                continue  # reschedule under the new layout
        k = 1
        if not chunks:  # pure decode; admission is blocked until something finishes
            k = min(sim.max_leap, min(r.output - r.generated for r in dec))
            while k > 1 and not fits(grow=k):
                k //= 2
        if k > 1:
            mid = BatchShape([c + k // 2 for c in batch.decode_ctx], (), batch.owners)
            dt = cm.step_time_ms(cur, mid)
            if pending:
                k = max(1, min(k, int((pending[0].arrival_ms - t) // max(dt, 1e-9))))
        else:
            dt = cm.step_time_ms(cur, batch)
        t += k * dt
        steps += k
        for r in dec:
            r.computed += k
            r.generated += k
        for r, n in chunks:
            r.computed += n
            if r.computed >= r.target:
                r.generated += 1
                if r.first_ms is None:
                    r.first_ms = t
        done = [r for r in running if r.generated >= r.output]
        for r in done:
            r.finish_ms = t
        if done:
            running = [r for r in running if r.generated < r.output]
    return _metrics(reqs, t, steps, preemptions, switches, timeline, layout)


def _schedule(running: list[_Req], budget: int, owners: list[int] | None):
    """(decode requests, prefill chunks, BatchShape) of one step; ``owners`` per running
    request under an owned layout (the prefill budget is then shared among owners), else None."""
    dec = [r for r in running if r.computed >= r.target]
    own = dict(zip(map(id, running), owners)) if owners is not None else None
    prefilling = [r for r in running if r.computed < r.target]
    chunks = _prefill_chunks(prefilling, budget - len(dec), own)
    order = dec + [r for r, _ in chunks]
    batch = BatchShape([r.computed + 1 for r in dec], [(n, r.computed) for r, n in chunks],
                       [own[id(r)] for r in order] if own is not None else None)
    return dec, chunks, batch


def _prefill_chunks(prefilling: list[_Req], budget: int,
                    owner_of: dict[int, int] | None) -> list[tuple[_Req, int]]:
    """Chunks (request, rows) filling ``budget`` FCFS; under owned layouts (``owner_of``: id of
    request -> owner) each owner first gets an equal share, leftover rows then go FCFS."""
    chunks: dict[int, int] = {}
    if owner_of is not None and prefilling and budget > 0:
        owners = sorted({owner_of[id(r)] for r in prefilling})
        share = budget // len(owners)
        left = dict.fromkeys(owners, share)
        for i, r in enumerate(prefilling):
            o = owner_of[id(r)]
            n = min(r.target - r.computed, left[o])
            if n > 0:
                chunks[i], left[o], budget = n, left[o] - n, budget - n
    for i, r in enumerate(prefilling):
        n = min(r.target - r.computed - chunks.get(i, 0), budget)
        if n > 0:
            chunks[i], budget = chunks.get(i, 0) + n, budget - n
    return [(prefilling[i], n) for i, n in sorted(chunks.items())]


def _metrics(reqs: list[_Req], t_ms: float, steps: int, preemptions: int, switches: list,
             timeline: list, layout: str) -> dict:
    out_tokens = sum(r.output for r in reqs)
    all_tokens = out_tokens + sum(r.prompt for r in reqs)
    ttft = np.array([r.first_ms - r.arrival_ms for r in reqs if r.first_ms is not None])
    tpot = np.array([(r.finish_ms - r.first_ms) / (r.output - 1) for r in reqs
                     if r.output > 1 and r.first_ms is not None and r.finish_ms is not None])

    def pct(x: np.ndarray, q: float) -> float:
        return round(float(np.percentile(x, q)), 3) if len(x) else 0.0

    secs = max(t_ms / 1e3, 1e-9)
    return {"layout": layout, "makespan_s": round(secs, 3),
            "output_tok_s": round(out_tokens / secs, 1), "total_tok_s": round(all_tokens / secs, 1),
            "ttft_s": {"p50": pct(ttft / 1e3, 50), "p99": pct(ttft / 1e3, 99)},
            "tpot_ms": {"p50": pct(tpot, 50), "p99": pct(tpot, 99)},
            "steps": steps, "preemptions": preemptions, "num_switches": len(switches),
            "switches": switches, "timeline": timeline}


def compare(trace: Sequence, cfg, profile, tp: int, sim: SimConfig | None = None,
            layouts: Sequence[str] = ("tp", "dp", "cp", "dop")) -> dict:
    """`auto` and every fixed layout on the same trace; ``best_fixed`` and auto's ratio to it."""
    sim = sim or SimConfig()
    models = build_models(cfg, profile, tp, sim)
    runs: dict[str, dict[str, Any]] = {}
    for name in ("auto", *layouts):
        models[1].reset()
        if name != "auto" and name not in models[1].layouts:
            runs[name] = {"layout": name, "output_tok_s": 0.0,
                          "error": f"{cfg.num_attention_heads} heads do not split over {tp} ranks"}
            continue
        try:
            runs[name] = simulate(trace, cfg, profile, tp, name, sim, models)
        except RuntimeError as e:  # a fixed layout too small for the trace's longest request
            runs[name] = {"layout": name, "error": str(e), "output_tok_s": 0.0}
    best = max(layouts, key=lambda n: runs[n]["output_tok_s"])
    ratio = runs["auto"]["output_tok_s"] / max(runs[best]["output_tok_s"], 1e-9)
    return {"runs": runs, "best_fixed": best, "auto_vs_best_fixed": round(ratio, 4)}


def load_trace(name: str, seed: int = 0, n: int | None = None) -> list:
    """A trace by generator name or .jsonl path."""
    return workloads.get_trace(name, seed, n)

