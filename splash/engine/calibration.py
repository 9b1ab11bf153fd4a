"""`splash calibrate --model DIR`: fit the cost model to the engine's own step and switch times.

First the hardware micro-benchmarks (`splash.planning.calibrate`: matmul rate, copy bandwidth,
all-gather bandwidth and latency). Then, on ``--model`` with ``--tp`` ranks, one engine serves a
small sweep in every layout that fits: for each (batch, context) decode point the requests are
prefilled once, then each layout in turn is switched to (a blocking switch: its transfer time is
one measurement) and a few decode steps are timed (wall time of an engine step, host work
included); then a prefill chunk is timed in each layout. The profile's free fields are fitted to
these times (`splash.planning.fit`) and written as JSON, with the table of predicted vs measured
times under the spec, roofline and fitted profiles. ``SPLASH_CALIBRATION=<file>`` makes every
engine (and `splash plan` / `simulate` with ``--calibration``) use it.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from splash import envs
from splash.backends import HardwareProfile, get_backend
from splash.core.ownership import get_layout
from splash.core.shapes import BatchShape
from splash.engine.config import EngineConfig
from splash.engine.llm_engine import LLMEngine
from splash.errors import ConfigError
from splash.logging_utils import get_logger
from splash.planning.calibrate import calibrate as measure_hardware
from splash.planning.fit import (
    StepPoint,
    SwitchPoint,
    error_table,
    fit_profile,
    format_table,
    neutral,
)
from splash.sampling_params import SamplingParams

logger = get_logger("splash.calibrate")

# (decode points (batch, context), prefill chunk, warm-up steps, timed steps, prefill repeats);
# contexts stay below a power-of-two page count (64-token pages) for the ~50 steps a point
# decodes, so every timed step replays one CUDA graph per layout
SWEEPS = {
    "gpu": ([(1, 900), (8, 4000), (32, 1900), (64, 400), (16, 7000)], 2048, 3, 8, 3),
    "quick": ([(1, 12), (4, 24)], 24, 1, 2, 1),
}


@dataclasses.dataclass
class Measurements:
    steps: list[StepPoint] = dataclasses.field(default_factory=list)
    switches: list[SwitchPoint] = dataclasses.field(default_factory=list)


def _shape(eng: LLMEngine) -> BatchShape:
    """The work of the step the scheduler is about to run, as running requests stand."""
    decode, prefill, owners = [], [], []
    for r in eng.scheduler.running:
        if r.num_pending <= 1:
            decode.append(r.num_computed + 1)
            owners.append(r.owner)
    for r in eng.scheduler.running:
        if r.num_pending > 1:
            prefill.append((r.num_pending, r.num_computed))
            owners.append(r.owner)
    return BatchShape(decode, prefill, owners if get_layout(eng.layout).uses_owners else None)


def _timed_step(eng: LLMEngine) -> float:
    t0 = time.perf_counter()
    eng.step()
    return (time.perf_counter() - t0) * 1e3


def _switch(eng: LLMEngine, layout: str, out: Measurements) -> None:
    """Switch to ``layout`` within a step and record the transfer as a switch point."""
    if eng.layout == layout:
        return
    running = list(eng.scheduler.running)
    src = eng.layout
    owners = tuple(r.owner for r in running) if get_layout(src).uses_owners else None
    live = tuple(r.num_computed for r in running)
    before = len(eng.switches.history)
    eng.switch_layout(layout)
    batch = _shape(eng)
    for _ in range(3):  # the step in flight, then the switching step
        eng.step()
        if len(eng.switches.history) > before:
            break
    if len(eng.switches.history) > before and running:
        entry = eng.switches.history[-1]
        out.switches.append(SwitchPoint(src, layout, batch, live, owners, entry["overhead_ms"]))


def _sweep(eng: LLMEngine, quick: bool) -> Measurements:
    points, chunk, warm, timed, repeats = SWEEPS["quick" if quick else "gpu"]
    out = Measurements()
    layouts = list(eng.setup.fitting)
    vocab = max(eng.vocab_size - 2, 1)
    for i, (batch, context) in enumerate(points):
        params = SamplingParams(max_tokens=len(layouts) * (warm + timed + 2) + 8,
                                temperature=0.0, ignore_eos=True)
        ids = [eng.add_request([2 + (i * 31 + b * 7919 + j) % vocab for j in range(context)],
                               params) for b in range(batch)]
        while any(r.num_pending > 1 for r in eng.scheduler.running) or eng.scheduler.waiting:
            eng.step()
        for layout in layouts[i % len(layouts):] + layouts[:i % len(layouts)]:
            _switch(eng, layout, out)
            for _ in range(warm):
                eng.step()
            times, shapes = [], []
            for _ in range(timed):
                shapes.append(_shape(eng))
                times.append(_timed_step(eng))
            mid = sorted(range(timed), key=lambda k: times[k])[timed // 2]
            out.steps.append(StepPoint(layout, shapes[mid], statistics.median(times)))
            logger.info("calibrate: %s decode batch %d context %d: %.2f ms/step", layout, batch,
                        context, statistics.median(times))
        for rid in ids:
            eng.abort_request(rid)
        eng.step()  # the aborts' outputs
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for k, layout in enumerate(layouts):
        _switch(eng, layout, out)
        times = []
        shape = BatchShape()
        for r in range(repeats + 1):  # the first is a warm-up
            eng.add_request([2 + (k * 131 + r * 17 + j) % vocab for j in range(chunk)], one)
            t = _timed_step(eng)  # admits and prefills the chunk, samples its token
            shape = BatchShape((), ((chunk, 0),), [0] if get_layout(layout).uses_owners else None)
            while eng.has_unfinished():
                eng.step()
            if r:
                times.append(t)
        out.steps.append(StepPoint(layout, shape, statistics.median(times), kind="prefill"))
        logger.info("calibrate: %s prefill chunk %d: %.2f ms", layout, chunk,
                    statistics.median(times))
    return out


def calibrate_engine(model: str, backend: str, tp: int, quick: bool = False,
                     dtype: str | None = None) -> dict[str, Any]:
    """Micro-benchmarks, then the engine sweep and the fit; the profile dict to write."""
    if tp < 2:
        raise ConfigError("calibrating against the engine needs --tp >= 2 (at T=1 every "
                          "layout is the same)")
    t0 = time.perf_counter()
    hw = measure_hardware(backend, tp, quick)
    if torch.cuda.is_available():  # the benchmarks' buffers would count against the KV budget
        torch.cuda.empty_cache()
    fields = {f.name for f in dataclasses.fields(HardwareProfile)}
    roofline = HardwareProfile(**{k: v for k, v in hw.items() if k in fields})
    spec = get_backend(backend).profile
    kw: dict[str, Any] = {"warmup": False, "layout": "tp", "switch_mode": "blocking",
                          "enable_prefix_caching": False, "dtype": dtype}
    if quick:
        kw.update(max_num_batched_tokens=32, kv_pages_per_rank=64, max_num_seqs=16)
    eng = LLMEngine(EngineConfig(model=model, tp_size=tp, backend=backend, **kw))
    try:
        if eng.setup.backend_name != "cpu":
            eng.warm_up(list(eng.setup.fitting))
        meas = _sweep(eng, quick)
        mem, setup = eng.setup.memory, eng.setup
        model_kw = {"weight_dtype": mem.weight_dtype, "kv_dtype": mem.kv_dtype,
                    "page_size": setup.page_size}
        cfg = setup.model_cfg
    finally:
        eng.shutdown()
    fitted = fit_profile(cfg, tp, roofline, meas.steps, meas.switches, **model_kw)
    profiles = {"spec": spec, "roofline": neutral(roofline), "fitted": fitted}
    table = error_table(cfg, tp, profiles, meas.steps, meas.switches, **model_kw)
    out = dataclasses.asdict(dataclasses.replace(fitted, source="calibrate"))
    out["measured"] = hw["measured"]
    out["fit"] = {"model": model, "tp": tp, "quick": quick, "dtype": mem.weight_dtype,
                  "kv_dtype": mem.kv_dtype, "seconds": round(time.perf_counter() - t0, 1),
                  **table}
    out["table"] = format_table(table, list(profiles))
    return out


def calibrate_main(args) -> int:
    """`splash calibrate`: micro-benchmarks only, or with ``--model`` the engine fit too."""
    quick = bool(getattr(args, "quick", False))
    if not getattr(args, "model", None):
        result = measure_hardware(args.backend, args.tp_size, quick)
    else:
        result = calibrate_engine(args.model, args.backend, args.tp_size, quick,
                                  getattr(args, "dtype", None))
    out = args.out or str(Path(envs.get("SPLASH_CACHE_DIR")) / "calibration" /
                          f"{result['name']}-tp{args.tp_size}.json")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1))
    if "table" in result:
        Path(out).with_suffix(".txt").write_text(result["table"] + "\n")
        print(result["table"])
        print(f"profile written to {out}; use it with SPLASH_CALIBRATION={out}")
        return 0
    result["written_to"] = out
    print(json.dumps(result))
    return 0
