"""`splash simulate`: the simulator's report — auto against each fixed layout on a trace, then
the regime map (the best layout over input length x batch), as text or JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict

from splash.errors import LayoutInfeasibleError
from splash.planning.planner import plan, resolve_hardware, resolve_model
from splash.planning.regimes import regime_map
from splash.planning.simulator import SimConfig, compare, load_trace


def _nothing_fits(error: str, trace: Sequence, cfg, profile, tp: int, sim: SimConfig) -> str:
    """One line: no layout serves the trace, why, and what would fit (from `splash plan`)."""
    longest = max(r.prompt_len + r.output_len for r in trace)
    p = plan(cfg, profile, tp, batch=1, input_len=longest, memory_fraction=sim.memory_fraction,
             kv_dtype=sim.kv_dtype, weight_dtype=sim.weight_dtype, page_size=sim.page_size)
    why = p["reason"] if p["chosen"] is None else f"with {p['reason']}"
    return (f"no layout serves this trace on {tp}x {profile.name} ({sim.weight_dtype} weights, "
            f"{sim.kv_dtype} KV): {error}; {why}")


def simulate_main(args) -> int:
    """`splash simulate`: auto vs fixed layouts on a trace, plus the regime map."""
    cfg, model_name = resolve_model(args.model)
    profile = resolve_hardware(args.hardware, getattr(args, "calibration", None))
    sim = SimConfig(weight_dtype=getattr(args, "weight_dtype", None) or "fp8",
                    kv_dtype=getattr(args, "kv_dtype", None) or "fp8")
    trace = load_trace(args.trace, args.seed, getattr(args, "requests", None))
    result = {"model": model_name, "hardware": profile.name, "tp": args.tp_size,
              "trace": args.trace, "requests": len(trace), "sim": asdict(sim)}
    result.update(compare(trace, cfg, profile, args.tp_size, sim))
    if all("error" in r for r in result["runs"].values()):
        raise LayoutInfeasibleError(_nothing_fits(result["runs"]["auto"]["error"], trace, cfg,
                                                  profile, args.tp_size, sim))
    result["regime_map"] = regime_map(cfg, profile, args.tp_size, sim)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{model_name} on {args.tp_size}x {profile.name} ({sim.weight_dtype} weights, "
          f"{sim.kv_dtype} KV), trace {args.trace} ({len(trace)} requests)")
    print(f"{'layout':8}{'out tok/s':>12}{'TTFT p50 s':>12}{'TPOT p50 ms':>13}{'switches':>10}")
    for name, r in result["runs"].items():
        if "error" in r:
            print(f"{name:8}  {r['error']}")
            continue
        print(f"{name:8}{r['output_tok_s']:>12.0f}{r['ttft_s']['p50']:>12.2f}"
              f"{r['tpot_ms']['p50']:>13.2f}{r['num_switches']:>10}")
    print(f"auto / best fixed ({result['best_fixed']}): {result['auto_vs_best_fixed']:.3f}")
    if "timeline" in result["runs"]["auto"]:
        auto_tl = " -> ".join(f"{e['layout']}@{e['t_s']:.1f}s"
                              for e in result["runs"]["auto"]["timeline"])
        print(f"auto timeline: {auto_tl}")
    for mode, grid in result["regime_map"]["best"].items():
        print(f"\nbest layout at {mode} (rows: input length, columns: batch "
              f"{result['regime_map']['batches']})")
        for length, row in zip(result["regime_map"]["inputs"], grid):
            print(f"{length:>8} " + " ".join(f"{x:>4}" for x in row))
    return 0
