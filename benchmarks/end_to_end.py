"""End-to-end: each trace served with layout="auto" and with every fixed layout — throughput,
TTFT/TPOT p50/p99, switches, the policy's audited decisions, and a PNG of the layout timeline.

    python benchmarks/end_to_end.py --trace all                        # CPU, tiny model
    SPLASH_CALIBRATION=cal.json python benchmarks/end_to_end.py --backend cuda --tp 2 \\
        --trace all --out-dir $OUT                                    # 2 GPUs, V3-shaped

Every run sees the same requests (token ids included) arriving at the same times. One engine
per layout serves the traces in turn; each engine warms up at start-up (a prefill chunk and
decode steps in every layout it may use: Triton compiles and the first graphs), so no run pays
compilation inside its timing. Before each trace the auto engine returns to TP and forgets the
policy's history. ``--one-engine`` (the default on GPUs, where an engine takes most of a minute
to start) serves every run from one auto engine instead: a fixed run pins its layout with a
manual switch before the trace starts, every run starts with an empty prefix cache, and each
trace is first served once unmeasured under auto: the one-off costs of a shape's first use
(Triton specialisations, graphs captured for wider block tables) then land in no measured
run (on 2 x H200 the first run paid 1.5 s in one step for them). A run that outlasts ``--run-timeout-s`` is cut (its requests aborted) and
marked ``complete: false``. Sizes per trace (``--trace-size``) are "gpu" (H200, DeepSeek-V3
dims with 8 layers: about 5-15 s a run) or "cpu" (tiny model, Triton interpreter: figures are
not GPU claims). Results: ``<out-dir>/end_to_end_<trace>_tp<T>.json`` (+ ``.png``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import numpy as np
from _results import save_json  # noqa: E402  (benchmarks/ is on sys.path)

from splash import LLM, SamplingParams
from splash.planning.workloads import TraceRequest, get_trace

LAYOUTS = ["auto", "tp", "dp", "cp", "dop"]
TRACES = ["rollout", "stationary", "bursty", "agentic"]
SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "gpu": {
        "rollout": dict(n=64, group=8, prompt_median=512, max_prompt=2048, output_median=160,
                        output_sigma=1.0, max_output=768),
        "stationary": dict(n=64, prompt_len=1024, output_len=128),
        "bursty": dict(n=96, bursts=4, gap_s=2.0, burst_span_s=0.5, prompt_median=512,
                       max_prompt=2048, output_median=128, max_output=512),
        "agentic": dict(sessions=8, turns=3, prefix_len=2048, turn_len=512, output_median=128,
                        max_output=512, gap_s=3.0),
    },
    "cpu": {
        "rollout": dict(n=8, group=4, prompt_median=48, max_prompt=48, output_median=6,
                        output_sigma=1.0, max_output=16),
        "stationary": dict(n=6, prompt_len=32, output_len=8),
        "bursty": dict(n=8, bursts=2, gap_s=2.0, burst_span_s=0.2, prompt_median=24,
                       max_prompt=48, output_median=6, max_output=12),
        "agentic": dict(sessions=2, turns=2, prefix_len=32, turn_len=8, output_median=6,
                        max_output=12, gap_s=2.0),
    },
}


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def prompts_for(trace: list[TraceRequest], vocab: int, seed: int) -> list[list[int]]:
    """Token ids per request: requests of one ``prefix_group`` continue one token stream (a
    session's growing context, a prompt's samples), the first ``common_prefix_len`` tokens are
    shared by all; seeded, so every run gets the same ids."""
    rng = np.random.default_rng(seed)
    hi = max(vocab - 1, 3)
    common = rng.integers(2, hi, max((r.common_prefix_len for r in trace), default=0))
    longest: dict[int, int] = {}
    for r in trace:
        if r.prefix_group is not None:
            longest[r.prefix_group] = max(longest.get(r.prefix_group, 0), r.prompt_len)
    streams = {g: rng.integers(2, hi, n) for g, n in sorted(longest.items())}
    out = []
    for r in trace:
        body = streams[r.prefix_group] if r.prefix_group is not None else \
            rng.integers(2, hi, r.prompt_len)
        ids = np.concatenate([common[:r.common_prefix_len], body[r.common_prefix_len:r.prompt_len]])
        out.append([int(t) for t in ids])
    return out


def back_to_start(llm: LLM, start: str) -> None:
    """auto: the next trace starts in ``start`` with a fresh policy (pin, switch, release)."""
    eng = llm.engine
    if eng.auto is None:
        return
    if eng.layout != start:
        eng.switch_layout(start)
        while eng.layout != start or eng.switches.inflight is not None:
            eng.step()
    eng.switch_layout("auto")
    eng.auto.reset()


def use_layout(llm: LLM, layout: str) -> None:
    """One engine for every run: ``layout`` pinned by a manual switch (or auto released from
    TP), nothing of an earlier run left in the prefix cache."""
    eng = llm.engine
    if layout == "auto":
        back_to_start(llm, "tp")
    else:
        eng.switch_layout(layout)
        while eng.layout != layout or eng.switches.inflight is not None:
            eng.step()
    eng.scheduler.prefix.clear()


def serve(llm: LLM, trace: list[TraceRequest], prompts: list[list[int]], args,
          layout: str | None = None) -> dict:
    """One run: requests added at their (scaled) arrival, the engine stepped until done;
    ``layout``: the run's layout in a shared engine (`use_layout`), else the engine's own."""
    eng = llm.engine
    if layout is None:
        back_to_start(llm, "tp")
        layout = eng.cfg.layout
    else:
        use_layout(llm, layout)
    switches_before = len(eng.switches.history)
    steps_before, graphs_before = eng.step_count, eng.stats()["graph_steps"]
    pending = sorted(range(len(trace)), key=lambda i: trace[i].arrival_s)
    arrive, first, done, ntok, rid_of = {}, {}, {}, {}, {}
    timeline: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    complete = True
    while pending or eng.has_unfinished():
        now = time.perf_counter() - t0
        if now > args.run_timeout_s:
            complete = False
            for rid in list(eng.requests):
                eng.abort_request(rid)
            eng.step()
            break
        while pending and trace[pending[0]].arrival_s * args.time_scale <= now:
            i = pending.pop(0)
            r = trace[i]
            sp = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
            rid = eng.add_request(prompts[i], sp, request_id=f"t{i}")
            arrive[rid], rid_of[rid] = r.arrival_s * args.time_scale, i
        if not eng.has_unfinished():
            time.sleep(min(0.005, max(trace[pending[0]].arrival_s * args.time_scale - now, 0)))
            continue
        s0 = time.perf_counter()
        outs = eng.step()
        s1 = time.perf_counter()
        timeline.append({"t": round(s0 - t0, 4), "ms": round((s1 - s0) * 1e3, 3),
                         "layout": eng.layout, "running": len(eng.scheduler.running)})
        for o in outs:
            if o.token_ids:
                first.setdefault(o.request_id, s1 - t0)
            if o.finished:
                done[o.request_id], ntok[o.request_id] = s1 - t0, len(o.token_ids)
    elapsed = max(done.values(), default=time.perf_counter() - t0)
    st = llm.stats()
    ttft = [first[r] - arrive[r] for r in done if r in first]
    tpot = [(done[r] - first[r]) / (ntok[r] - 1) for r in done if ntok[r] > 1 and r in first]
    audit = st["policy_audit"] if layout == "auto" else []  # a pinned run decides nothing
    made = [e for e in audit if e["switched"]]
    run = {
        "layout": layout, "complete": complete, "elapsed_s": round(elapsed, 3),
        "requests_done": len(done), "tokens": sum(ntok.values()),
        "tokens_per_s": sum(ntok.values()) / max(elapsed, 1e-9),
        "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
        "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99),
        "steps": st["num_steps"] - steps_before,
        "graph_steps": st["graph_steps"] - graphs_before,
        "step_ms_total": round(sum(t["ms"] for t in timeline), 1),
        "switches": [{k: s.get(k) for k in ("step", "from", "to", "mode", "overhead_ms")}
                     for s in st["switches"][switches_before:]],
        "cost_model_source": st["cost_model_source"],
        "policy_audit": audit,
        "realized_vs_predicted_gain_ms": [
            (e["predicted_gain_ms"], e.get("realized_gain_ms")) for e in made],
        "declined": {k: sum(e["count"] for e in audit if not e["switched"] and e["kind"] == k)
                     for k in sorted({e["kind"] for e in audit if not e["switched"]})},
        "timeline": timeline,
    }
    run["outside_steps_s"] = round(elapsed - run["step_ms_total"] / 1e3, 3)
    return run


def plot(result: dict, png: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no timeline PNG", flush=True)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"tp": "tab:blue", "dp": "tab:orange", "cp": "tab:green", "dop": "tab:red"}
    runs = result["runs"]
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(runs) + 1.2))
    for row, r in enumerate(runs):
        ts = np.array([t["t"] for t in r["timeline"]])
        ws = np.array([t["ms"] for t in r["timeline"]]) / 1e3
        lays = [t["layout"] for t in r["timeline"]]
        for name, color in colors.items():
            mask = np.array([lay == name for lay in lays], dtype=bool)
            if mask.any():
                ax.broken_barh(list(zip(ts[mask], ws[mask])), (row - 0.35, 0.7), color=color)
    ax.set_yticks(range(len(runs)), [f"{r['layout']} {r['tokens_per_s']:.0f} tok/s"
                                     for r in runs])
    ax.set_xlabel("seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, list(colors), ncol=4, loc="upper right", fontsize=8)
    ax.set_title(f"layout per step, trace {result['trace']} (T={result['tp']}); auto / best "
                 f"fixed = {result['auto_vs_best_fixed']:.3f}")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return True


def trace_of(name: str, size: str, args) -> list[TraceRequest]:
    params = dict(SIZES[size].get(name, {}))
    count = params.pop("sessions" if name == "agentic" else "n", None)
    return get_trace(name, seed=args.seed, n=args.n or count, **params)


def checkpoint(args) -> str:
    if args.ckpt:
        return args.ckpt
    if args.backend == "cpu":
        from splash.model.presets import make_model

        path = f"/tmp/splash-e2e-bench-{args.layers}"
        if not os.path.exists(os.path.join(path, "config.json")):
            make_model(path, "deepseek-v3", layers=args.layers, seed=0, scale="tiny")
        return path
    import multi_gpu

    return multi_gpu.build(f"/tmp/splash-v3-{args.layers}l-o1", args.layers, 32)


def write_results(names, runs, traces, size, path, out_dir, args, final=False) -> list[str]:
    """One JSON (+ PNG when final) per trace with the runs so far; a summary line each."""
    cpu = args.backend == "cpu"
    summaries = []
    for name in names:
        fixed = [r for r in runs[name] if r["layout"] != "auto"]
        auto = next((r for r in runs[name] if r["layout"] == "auto"), None)
        best = max(fixed, key=lambda r: r["tokens_per_s"]) if fixed else None
        ratio = auto["tokens_per_s"] / best["tokens_per_s"] if auto and best else float("nan")
        result = {"benchmark": "end_to_end", "trace": name, "trace_params": SIZES[size].get(name),
                  "kv_pages_per_rank": args.kv_pages_per_rank,
                  "seed": args.seed, "requests": len(traces[name]), "tp": args.tp,
                  "backend": args.backend, "checkpoint": path, "time_scale": args.time_scale,
                  "auto_vs_best_fixed": ratio, "best_fixed": best and best["layout"],
                  "all_complete": all(r["complete"] for r in runs[name]),
                  "calibration": os.environ.get("SPLASH_CALIBRATION") or None,
                  "runs": runs[name]}
        if cpu:
            result["note"] = "CPU figures (Triton interpreter + gloo) are not GPU claims"
        out = os.path.join(out_dir, f"end_to_end_{name}_tp{args.tp}.json")
        save_json(out, result)
        if final:
            plot(result, out.replace(".json", ".png"))
        line = " | ".join(f"{r['layout']} {r['tokens_per_s']:.0f}" for r in runs[name])
        summaries.append(f"{name}: {line} tokens/s; auto switched "
                         f"{len(auto['switches']) if auto else 0}x; auto / best fixed "
                         f"({result['best_fixed']}) = {ratio:.3f} -> {out}")
    return summaries


def _engine_kw(args) -> dict[str, Any]:
    """A KV budget of ``--kv-pages-per-rank`` pages: the room a full-size model leaves (a
    memory-bound deployment, where TP's replicated latent KV holds half the requests DP and
    DOP hold at T=2)."""
    return {"kv_pages_per_rank": args.kv_pages_per_rank} if args.kv_pages_per_rank else {}


def _report(name: str, layout: str, r: dict) -> None:
    print(f"{name:>10} {layout:>4}: {r['tokens_per_s']:8.1f} tokens/s  TTFT p50 "
          f"{r['ttft_p50_s'] or 0:.3f} s  TPOT p50 {r['tpot_p50_s'] or 0:.4f} s  "
          f"switches {len(r['switches'])}  {r['elapsed_s']:.1f} s"
          f"{'' if r['complete'] else '  (cut)'}", flush=True)


def serve_one_engine(path, layouts, names, traces, runs, size, out_dir, args) -> None:
    """Every run from one auto engine (`use_layout`) after unmeasured warm runs of each trace;
    results written after each run."""
    t0 = time.perf_counter()
    with LLM(path, tp_size=args.tp, backend=args.backend, layout="auto",
             **_engine_kw(args)) as llm:
        startup = time.perf_counter() - t0
        vocab = llm.engine.vocab_size
        for name in names:
            prompts = prompts_for(traces[name], vocab, args.seed)
            for _ in range(args.warm_runs):
                w = serve(llm, traces[name], prompts, args, layout="auto")
                print(f"{name:>10} warm-up run (auto, not measured): {w['elapsed_s']:.1f} s",
                      flush=True)
            for layout in layouts:
                r = serve(llm, traces[name], prompts, args, layout=layout)
                r["engine_startup_s"], r["shared_engine"] = round(startup, 1), True
                runs[name].append(r)
                _report(name, layout, r)
                write_results(names, runs, traces, size, path, out_dir, args)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default="rollout", help=f"{' | '.join(TRACES)} | all")
    ap.add_argument("--trace-size", default=None, choices=list(SIZES),
                    help="default: gpu on GPUs, cpu on the CPU")
    ap.add_argument("--n", type=int, default=None, help="requests (sessions for agentic)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--time-scale", type=float, default=1.0, help="arrival seconds x this")
    ap.add_argument("--run-timeout-s", type=float, default=None,
                    help="cut a run after this long (default: 90 s on GPUs, 300 s on the CPU)")
    ap.add_argument("--layers", type=int, default=None, help="default: 2 on CPU, 8 on GPU")
    ap.add_argument("--ckpt", default=None, help="checkpoint dir (default: built)")
    ap.add_argument("--one-engine", action=argparse.BooleanOptionalAction, default=None,
                    help="serve every run from one auto engine (default: on GPUs)")
    ap.add_argument("--kv-pages-per-rank", type=int, default=None,
                    help="KV pages per rank (default: what memory allows); a small pool "
                    "emulates the room a full-size model leaves")
    ap.add_argument("--warm-runs", type=int, default=1,
                    help="unmeasured auto runs of each trace first (--one-engine only)")
    ap.add_argument("--out-dir", default=None,
                    help="default: benchmarks/results/cpu or benchmarks/results/h200x<T>")
    args = ap.parse_args()
    cpu = args.backend == "cpu"
    if cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    args.layers = args.layers or (2 if cpu else 8)
    args.run_timeout_s = args.run_timeout_s or (300.0 if cpu else 90.0)
    size = args.trace_size or ("cpu" if cpu else "gpu")
    out_dir = args.out_dir or ("benchmarks/results/cpu" if cpu
                               else f"benchmarks/results/h200x{args.tp}")
    names = TRACES if args.trace == "all" else args.trace.split(",")
    layouts = args.layouts.split(",")
    path = checkpoint(args)
    traces = {name: trace_of(name, size, args) for name in names}
    runs: dict[str, list[dict]] = {name: [] for name in names}
    one = not cpu if args.one_engine is None else args.one_engine
    if one:
        serve_one_engine(path, layouts, names, traces, runs, size, out_dir, args)
        print("\n".join(write_results(names, runs, traces, size, path, out_dir, args, final=True)))
        return 0
    for layout in layouts:
        t0 = time.perf_counter()
        with LLM(path, tp_size=args.tp, backend=args.backend, layout=layout,
                 **_engine_kw(args)) as llm:
            startup = time.perf_counter() - t0
            vocab = llm.engine.vocab_size
            for name in names:
                r = serve(llm, traces[name], prompts_for(traces[name], vocab, args.seed), args)
                r["engine_startup_s"] = round(startup, 1)
                runs[name].append(r)
                _report(name, layout, r)
        write_results(names, runs, traces, size, path, out_dir, args)  # kept if later runs die
    print("\n".join(write_results(names, runs, traces, size, path, out_dir, args, final=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
