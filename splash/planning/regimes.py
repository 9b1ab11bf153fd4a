"""Regime map: the best layout over input length × batch (the axes of the paper's Figure 4).

Two modes, each from the cost model and the memory accounting alone:
- ``decode``: tokens/s of one decode step with B requests at context L; a layout that cannot hold
  all B runs the ones it can (admission-limited).
- ``prefill``: tokens/s of prefilling B prompts of L in chunks of the token budget; requests are
  admitted in waves the layout's KV room holds (the paper's fixed-layout sweeps vary the prefill
  layout); owned layouts share each step's budget among the owners with work.
"""

from __future__ import annotations

import math

import numpy as np

from splash.core.ownership import fitting_layouts, get_layout
from splash.planning.cost_model import BatchShape, CostModel
from splash.planning.simulator import SimConfig, build_models

INPUTS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144, 524288)
BATCHES = (1, 4, 16, 32, 64, 128, 256)
SAMPLES = 12  # chunks of a prompt evaluated exactly; the rest interpolated


def max_resident(policy, layout: str, length: int, limit: int) -> int:
    """Most requests of ``length`` tokens (≤ limit) the layout's KV room holds at once."""
    lo, hi = 0, limit
    while lo < hi:
        m = (lo + hi + 1) // 2
        if policy.feasibility.feasible(layout, [length] * m, policy.budget_bytes):
            lo = m
        else:
            hi = m - 1
    return lo


def decode_tok_s(cm: CostModel, layout: str, batch: int, length: int, resident: int) -> float:
    m = min(batch, resident)
    return 0.0 if m == 0 else m / cm.step_time_ms(layout, BatchShape.decode(m, length)) * 1e3


def _round_ms(cm: CostModel, layout: str, a: int, c: int, length: int) -> float:
    """Prefill ``a`` concurrent prompts of ``length``, ``c`` rows of each per step."""
    T = cm.world
    owners = [i % T for i in range(a)] if get_layout(layout).uses_owners else None
    steps = math.ceil(length / c)
    picks = np.unique(np.linspace(0, steps - 1, min(steps, SAMPLES)).round().astype(int))
    times = [cm.step_time_ms(layout, BatchShape(
        prefill=[(min(c, length - j * c), j * c)] * a, owners=owners)) for j in picks]
    return float(np.interp(np.arange(steps), picks, times).sum())


def prefill_time_ms(cm: CostModel, layout: str, n: int, length: int, budget: int) -> float:
    """Time to prefill ``n`` resident prompts of ``length`` with ``budget`` rows per step."""
    total, left = 0.0, n
    owned = get_layout(layout).uses_owners
    while left > 0:
        active = min(left, cm.world) if owned else 1  # owners with work share the budget
        share = max(budget // active, 1)
        if length >= share:
            a, c = active, share
        else:  # several whole prompts per owner (or per step) fit the share
            a, c = min(left, active * (share // length)), length
        rounds = left // a
        total += rounds * _round_ms(cm, layout, a, c, length)
        left -= rounds * a
    return total


def prefill_tok_s(cm: CostModel, layout: str, batch: int, length: int, resident: int,
                  budget: int) -> float:
    if resident == 0:
        return 0.0
    wave = min(batch, resident)
    full, rest = divmod(batch, wave)
    t = full * prefill_time_ms(cm, layout, wave, length, budget)
    if rest:
        t += prefill_time_ms(cm, layout, rest, length, budget)
    return batch * length / t * 1e3


def _best(names: list[str], grid: dict, i: int, j: int) -> str:
    """The fastest layout at grid point (i, j); "-" where none can hold a request."""
    speed = {n: grid[n][i][j] for n in names}
    best = max(names, key=lambda n: speed[n])
    return best if speed[best] > 0 else "-"


def regime_map(cfg, profile, tp: int, sim=None, inputs=INPUTS, batches=BATCHES,
               modes=("decode", "prefill")) -> dict:
    """{inputs, batches, best: {mode: [[layout per batch] per input]}, tok_s: {mode: {layout:
    grid}}, max_resident: {layout: [per input]}}."""
    sim = sim or SimConfig()
    cm, policy = build_models(cfg, profile, tp, sim)
    names = [n for n in policy.layouts if n in fitting_layouts(cfg.num_attention_heads, tp)]
    top = max(batches)
    resident = {n: [max_resident(policy, n, length, top) for length in inputs] for n in names}
    out: dict = {"inputs": list(inputs), "batches": list(batches), "best": {}, "tok_s": {},
                 "max_resident": resident}
    for mode in modes:
        grid = {n: [[0.0] * len(batches) for _ in inputs] for n in names}
        for i, length in enumerate(inputs):
            for j, b in enumerate(batches):
                for n in names:
                    if mode == "decode":
                        v = decode_tok_s(cm, n, b, length, resident[n][i])
                    else:
                        v = prefill_tok_s(cm, n, b, length, resident[n][i],
                                          sim.max_num_batched_tokens)
                    grid[n][i][j] = round(v, 1)
        out["tok_s"][mode] = grid
        out["best"][mode] = [[_best(names, grid, i, j) for j in range(len(batches))]
                             for i in range(len(inputs))]
    return out
