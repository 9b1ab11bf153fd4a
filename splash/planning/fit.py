"""Fit the cost model to measured engine steps and switches (`splash calibrate --model DIR`).

The cost model's step time is linear in five profile fields once the hardware rates are fixed:

    step_ms = gemm_time_scale * gemm + attention_time_scale * attention
              + collective_latency_us * collectives + step_overhead_us
              + request_overhead_us * requests + (communication - hidden)

where ``gemm`` (projections, MLP, LM head), ``attention``, the collective count and the
communication terms come from the roofline with the measured rates. The five are fitted by
non-negative least squares on *relative* errors (every point weighs the same whatever its
size), so the fitted profile's error over the measured points is never above the unfitted one's:
the unfitted profile is one of the candidates. A switch's time is its predicted transfer
scaled by ``switch_time_scale`` plus a fixed ``switch_overhead_us`` (planning, installing heads,
launches: a switch that moves nothing still costs about a millisecond), both fitted the same
way after dropping the points a first fit misses by more than ``OUTLIER`` times (a first switch
into a layout that still connected its NCCL peers measured 80 ms where its twins took 2 ms).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from splash.backends.profiles import HardwareProfile
from splash.core.shapes import BatchShape
from splash.planning.cost_model import CostModel

GEMM_STAGES = ("common_proj", "proj", "mlp", "lm_head")
FITTED = ("gemm_time_scale", "attention_time_scale", "collective_latency_us", "step_overhead_us",
          "request_overhead_us")
LOWER = np.array([0.05, 0.05, 0.0, 0.0, 0.0])  # scales stay positive; latencies, overheads >= 0
OUTLIER = 4.0  # switch points measured above this many times the first fit are left out


@dataclass(frozen=True)
class StepPoint:
    """One measured step: its layout, its work and its median wall time."""

    layout: str
    batch: BatchShape
    measured_ms: float
    kind: str = "decode"  # decode | prefill (for the report)


@dataclass(frozen=True)
class SwitchPoint:
    """One measured switch: its transfer time (the workers' switch work) before ``batch``."""

    src: str
    dst: str
    batch: BatchShape
    live_tokens: tuple[int, ...]
    live_owners: tuple[int, ...] | None
    measured_ms: float


def nnls(a: np.ndarray, b: np.ndarray, tol: float = 1e-10) -> np.ndarray:
    """argmin ||a x - b|| over x >= 0 (Lawson and Hanson's active-set method)."""
    n = a.shape[1]
    x = np.zeros(n)
    free = np.zeros(n, dtype=bool)
    for _ in range(3 * n + 10):
        grad = a.T @ (b - a @ x)
        if free.all() or grad[~free].max() <= tol:
            break
        free[int(np.argmax(np.where(free, -np.inf, grad)))] = True
        while True:
            z = np.zeros(n)
            z[free] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
            if (z[free] > tol).all():
                break
            bad = free & (z <= tol)
            alpha = float(np.min(x[bad] / (x[bad] - z[bad])))
            x = x + alpha * (z - x)
            free &= x > tol
        x = z
    return x


def neutral(profile: HardwareProfile) -> HardwareProfile:
    """``profile`` with the fitted fields at their no-op values."""
    return dataclasses.replace(profile, gemm_time_scale=1.0, attention_time_scale=1.0,
                               step_overhead_us=0.0, request_overhead_us=0.0,
                               switch_time_scale=1.0, switch_overhead_us=0.0)


def _model(cfg: Any, world: int, profile: HardwareProfile, **kw: Any) -> CostModel:
    return CostModel(cfg, world, profile, sparse_attention=False, **kw)


def step_features(cm: CostModel, point: StepPoint) -> tuple[np.ndarray, float]:
    """(gemm ms, attention ms, collectives, 1, requests) of ``point`` under a neutral profile,
    and the part that does not depend on the fitted fields (communication minus what hides)."""
    bd = cm.breakdown(point.layout, point.batch)
    gemm = sum(bd[k] for k in GEMM_STAGES)
    fixed = bd["comm"] + bd["hidden"]
    return np.array([gemm, bd["attention"], bd["collectives"], 1.0,
                     point.batch.num_requests]), fixed


def fit_profile(cfg: Any, world: int, base: HardwareProfile, steps: Sequence[StepPoint],
                switches: Sequence[SwitchPoint] = (), **model_kw: Any) -> HardwareProfile:
    """``base`` with the fitted fields fitted to ``steps`` (and ``switches``), see the module
    docstring. ``model_kw``: the CostModel's dtypes and page size as the engine ran."""
    if not steps:
        raise ValueError("no measured steps to fit")
    start_from = neutral(base)
    cm = _model(cfg, world, start_from, **model_kw)
    rows, fixed = zip(*(step_features(cm, p) for p in steps))
    y = np.array([p.measured_ms for p in steps])
    a = np.array(rows) / y[:, None]  # relative errors: divide every row by its measurement
    b = (y - np.array(fixed)) / y
    a[:, 2:] *= 1e-3  # latency and overheads in µs -> ms
    used = np.abs(a).max(axis=0) > 0  # a column of zeros (no collectives at T=1) keeps base
    start = np.array([1.0, 1.0, base.collective_latency_us, 0.0, 0.0])
    lower = np.where(used, LOWER, start)
    x = lower.copy()
    x[used] += nnls(a[:, used], b - a @ lower)
    fitted = dict(zip(FITTED, (float(v) for v in x)))
    if switches:
        with_steps = dataclasses.replace(start_from, **fitted)
        fitted.update(_switch_fit(cfg, world, with_steps, switches, model_kw))
    return dataclasses.replace(start_from, **fitted)


def predict_switch(cm: CostModel, p: SwitchPoint) -> float:
    """The predicted transfer time (ms) of ``p``: the whole move, as a blocking switch does it."""
    return cm.switch_cost(p.src, p.dst, p.batch, p.live_tokens, p.live_owners).blocking_ms


def _switch_fit(cfg: Any, world: int, profile: HardwareProfile,
                switches: Sequence[SwitchPoint], model_kw: dict[str, Any]) -> dict[str, float]:
    """(switch_time_scale, switch_overhead_us) by non-negative least squares on relative
    errors, fitted twice: the second time without the first fit's outliers."""
    cm = _model(cfg, world, profile, **model_kw)
    pts = [(predict_switch(cm, p), p.measured_ms) for p in switches if p.measured_ms > 0]
    if not pts:
        return {}
    pred, y = (np.array(v) for v in zip(*pts))
    keep = np.ones(len(y), dtype=bool)
    x = np.array([1.0, 0.0])
    for _ in range(2):
        a = np.stack([pred / y, 1.0 / y], axis=1)[keep]
        x = nnls(a, np.ones(int(keep.sum())))
        if x[0] <= 0:  # nothing scales: keep the unfitted transfer time
            x[0] = 1.0
            x[1] = nnls(a[:, 1:], 1.0 - a[:, 0])[0]
        keep = y <= OUTLIER * (x[0] * pred + x[1])
    return {"switch_time_scale": float(max(x[0], 0.05)), "switch_overhead_us": float(x[1] * 1e3)}


def error_table(cfg: Any, world: int, profiles: dict[str, HardwareProfile],
                steps: Sequence[StepPoint], switches: Sequence[SwitchPoint] = (),
                **model_kw: Any) -> dict[str, Any]:
    """Predicted vs measured per point under each named profile, and per profile the RMS,
    mean and max relative error of steps and switches."""
    models = {name: _model(cfg, world, prof, **model_kw) for name, prof in profiles.items()}
    step_rows: list[dict[str, Any]] = []
    switch_rows: list[dict[str, Any]] = []
    for p in steps:
        pred = {n: cm.step_time_ms(p.layout, p.batch) for n, cm in models.items()}
        step_rows.append({"kind": p.kind, "layout": p.layout,
                          "batch": len(p.batch.decode_ctx) + len(p.batch.prefill),
                          "rows": p.batch.num_rows,
                          "context": int(max(p.batch.tokens_after(), default=0)),
                          "measured_ms": round(p.measured_ms, 4),
                          **{f"{n}_ms": round(v, 4) for n, v in pred.items()},
                          **{f"{n}_err": round(v / p.measured_ms - 1, 4)
                             for n, v in pred.items()}})
    for s in switches:
        pred = {n: predict_switch(cm, s) for n, cm in models.items()}
        switch_rows.append({"from": s.src, "to": s.dst, "measured_ms": round(s.measured_ms, 4),
                            "kv_tokens": int(sum(s.live_tokens)),
                            **{f"{n}_ms": round(v, 4) for n, v in pred.items()},
                            **{f"{n}_err": round(v / s.measured_ms - 1, 4)
                               for n, v in pred.items() if s.measured_ms > 0}})
    summary = {n: {"step": _errors([r[f"{n}_err"] for r in step_rows]),
                   "switch": _errors([r[f"{n}_err"] for r in switch_rows if f"{n}_err" in r])}
               for n in profiles}
    return {"steps": step_rows, "switches": switch_rows, "summary": summary}


def _errors(errs: list[float]) -> dict[str, float] | None:
    if not errs:
        return None
    e = np.abs(np.array(errs))
    return {"rms": round(float(np.sqrt((e**2).mean())), 4), "mean": round(float(e.mean()), 4),
            "max": round(float(e.max()), 4), "points": len(errs)}


def format_table(table: dict[str, Any], names: Sequence[str]) -> str:
    """The predicted-vs-measured table as text, one line per point, then the summary."""
    head = f"{'kind':<8}{'layout':<7}{'batch':>6}{'ctx':>7}{'measured':>10}"
    head += "".join(f"{n:>16}" for n in names)
    lines = ["step times (ms; relative error in brackets)", head]
    for r in table["steps"]:
        cells = "".join(f"{r[f'{n}_ms']:>8.2f} ({r[f'{n}_err']:+5.0%})" for n in names)
        lines.append(f"{r['kind']:<8}{r['layout']:<7}{r['batch']:>6}{r['context']:>7}"
                     f"{r['measured_ms']:>10.2f}{cells}")
    if table["switches"]:
        lines += ["", "switch transfer times (ms)",
                  f"{'from':<6}{'to':<6}{'kv tokens':>10}{'measured':>10}"
                  + "".join(f"{n:>16}" for n in names)]
        for r in table["switches"]:
            cells = "".join(f"{r[f'{n}_ms']:>8.2f} ({r.get(f'{n}_err', 0):+5.0%})"
                            for n in names)
            lines.append(f"{r['from']:<6}{r['to']:<6}{r['kv_tokens']:>10}"
                         f"{r['measured_ms']:>10.2f}{cells}")
    lines.append("")
    for n in names:
        s = table["summary"][n]
        for what in ("step", "switch"):
            if s[what]:
                lines.append(f"{n:>20} {what:<7} error: rms {s[what]['rms']:.1%}, mean "
                             f"{s[what]['mean']:.1%}, max {s[what]['max']:.1%} over "
                             f"{s[what]['points']} points")
    return "\n".join(lines)
