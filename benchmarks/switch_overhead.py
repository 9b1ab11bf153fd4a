"""Switch overhead per direction, measured as the paper does (its App. F.2).

Overhead = the measured time of the interval from the switch decision to one step after the
handoff, minus the same interval in a run that was already in the destination layout
(target-ready) with the same batch: n steps of the interval x that run's median decode step.

A batch of ``--batch`` requests with ``--prompt-len``-token prompts decodes while the engine
walks an Eulerian circuit of the 12 directions ``--rounds`` times, a new switch two steps after
the previous one completes; once per mode:

- ``auto``, the engine's default: picks a mechanism per switch from the predicted transfer
  and step times;
- ``background``: pre-copy while serving, then hand off;
- ``blocking``: move what is missing, then compute, reusing what the engine holds (resident
  projection heads under CUDA graphs, cached copies of pages an earlier switch left behind);
- ``cold``, the baseline: a blocking switch that reuses nothing (resident projections and the
  prefix cache off), so every byte the destination lacks moves, as a stop-the-world re-shard.

The "live" figures are auto's. The target-ready runs serve the same batch fixed in each
layout. Per direction: p50/p95 overhead, as % of the matched ready interval, the reduction
against the baseline (cold if measured, else blocking), bytes received, decision-to-handoff
time and the baseline transfer's GB/s (bytes received per rank over the transfer's device
time, pack to unpack, on the slowest rank; the workers' host time where the device does not
time it).

    python benchmarks/switch_overhead.py --backend cuda --tp 2 \
        --out benchmarks/results/h200x2/switch_overhead_tp2.json

On CPU (interpreter + gloo) figures are recorded, not claimed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

import torch
from _results import save_json  # noqa: E402  (benchmarks/ is on sys.path)

from splash import LLM, SamplingParams
from splash.planning.calibrate import measure_collectives

CIRCUIT = ["tp", "dp", "tp", "cp", "tp", "dop", "dp", "cp", "dp", "dop", "cp", "dop", "tp"]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(round(q * (len(xs) - 1))), len(xs) - 1)] if xs else float("nan")


def _prompts(batch: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(2, 200, (batch, length), generator=g).tolist()


def _engine(args, layout: str, mode: str = "auto") -> LLM:
    # max_num_seqs: the batch, so start-up captures only the graphs the runs can replay;
    # "cold": a blocking switch that reuses nothing (every byte the destination lacks moves)
    cold = dict(resident_projections=False, enable_prefix_caching=False) if mode == "cold" \
        else {}
    return LLM(args.ckpt, tp_size=args.tp, backend=args.backend, layout=layout,
               switch_mode="blocking" if mode == "cold" else mode, dtype=args.dtype,
               max_num_batched_tokens=args.chunk, max_num_seqs=max(args.batch, 1), **cold)


def _prefill(eng, args, max_tokens: int) -> None:
    for p in _prompts(args.batch, args.prompt_len):
        eng.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                          ignore_eos=True))
    while not all(r.output_token_ids for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()


def ready_step_ms(args, layout: str) -> float:
    """Median decode step of the batch served in ``layout`` from the start."""
    with _engine(args, layout) as llm:
        eng = llm.engine
        _prefill(eng, args, 4 + 2 * args.ready_steps)
        times = []
        for _ in range(args.ready_steps):
            t0 = time.perf_counter()
            eng.step()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times[2:])


def circuit(args, mode: str) -> list[dict]:
    """Walk the circuit; per switch: the interval's wall time and steps, and its history."""
    per_switch = len(CIRCUIT) - 1
    with _engine(args, CIRCUIT[0], mode) as llm:
        eng = llm.engine
        _prefill(eng, args, 10 + args.rounds * per_switch * 12)
        out = []
        for r in range(args.rounds):
            for dst in CIRCUIT[1:]:
                n_hist = len(eng.switches.history)
                eng.switch_layout(dst)
                t0, steps = time.perf_counter(), 0
                while len(eng.switches.history) == n_hist:  # decision ... handoff
                    eng.step()
                    steps += 1
                eng.step()  # one step after the handoff
                steps += 1
                entry = dict(eng.switches.history[-1])
                entry.update(interval_ms=(time.perf_counter() - t0) * 1e3, steps=steps, round=r)
                out.append(entry)
                for _ in range(2):  # let the destination settle
                    eng.step()
        if args.trace_dir and mode == args.modes.split(",")[0]:
            traced(eng, args.trace_dir, mode)
        return out


def traced(eng, out_dir: str, mode: str) -> None:
    """Profile the circuit's first two switches (not counted): a step before the switch (it
    absorbs the profiler's start), the switching step and the steps after, on every rank;
    with SPLASH_PROFILE_TRACE=1 the workers write their timelines too."""
    for dst in CIRCUIT[1:3]:
        eng.profile_steps(5, os.path.join(out_dir, f"{mode}-{eng.layout}-{dst}"))
        eng.step()
        eng.switch_layout(dst)
        for _ in range(7):  # the profiled steps, the one that stops the profiler, one more
            eng.step()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=None, help="max_num_batched_tokens")
    ap.add_argument("--ready-steps", type=int, default=12)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--modes", default="auto,background,blocking,cold")
    ap.add_argument("--out", default="benchmarks/results/cpu/switch_overhead.json")
    ap.add_argument("--trace-dir", default=None,
                    help="after the first mode's circuit, profile its first two switches on "
                         "every worker into this directory (timelines too)")
    args = ap.parse_args()
    if args.trace_dir:
        os.environ["SPLASH_PROFILE_TRACE"] = "1"  # the workers inherit it
    if args.ckpt is None:
        if args.backend == "cuda":
            sys.path.insert(0, os.path.dirname(__file__))
            import multi_gpu

            args.ckpt = multi_gpu.build(f"/tmp/splash-v3-{args.layers}l-o1", args.layers, 32)
        else:
            from splash.model.presets import make_model

            args.ckpt = f"/tmp/splash-switch-bench-{args.layers}"
            if not os.path.exists(os.path.join(args.ckpt, "config.json")):
                make_model(args.ckpt, "deepseek-v3", layers=args.layers, seed=0, scale="tiny")
    args.dtype = args.dtype or ("fp32" if args.backend == "cpu" else "bf16")
    ready = {lay: ready_step_ms(args, lay) for lay in ("tp", "dp", "cp", "dop")}
    link = measure_collectives(args.tp, "nccl" if args.backend == "cuda" else "gloo") \
        if args.tp > 1 else {}
    runs: dict[str, list[dict]] = {}
    for mode in args.modes.split(","):  # results kept after each mode (a cut run keeps them)
        runs[mode] = circuit(args, mode)
        save_json(args.out, summarize(args, ready, runs, link))
    return 0


def summarize(args, ready: dict[str, float], runs: dict[str, list[dict]], link: dict) -> dict:
    """Per direction and mode: overhead against the ready interval, the switch's parts."""
    link_gbps = link.get("allgather_busbw_gbps")
    directions = []
    for src, dst in zip(CIRCUIT, CIRCUIT[1:]):
        rec: dict = {"from": src, "to": dst, "ready_step_ms": ready[dst]}
        for mode, entries in runs.items():
            mine = [e for e in entries if (e["from"], e["to"]) == (src, dst)]
            over = [e["interval_ms"] - e["steps"] * ready[dst] for e in mine]
            pct = [100 * o / (e["steps"] * ready[dst]) for o, e in zip(over, mine)]
            rec[mode] = {"overhead_p50_ms": _pct(over, 0.5), "overhead_p95_ms": _pct(over, 0.95),
                         "pct_of_ready_interval_p50": _pct(pct, 0.5),
                         "steps_p50": _pct([e["steps"] for e in mine], 0.5),
                         "decision_to_handoff_ms_p50": _pct(
                             [e.get("decision_to_handoff_ms", e["interval_ms"]) for e in mine],
                             0.5),
                         "worker_switch_ms_p50": _pct([e["overhead_ms"] for e in mine], 0.5),
                         "transfer_device_ms_p50": _pct(
                             [e["transfer_device_ms"] for e in mine
                              if e.get("transfer_device_ms") is not None], 0.5),
                         "controller_ms_p50": _pct([e.get("controller_ms", 0.0)
                                                    for e in mine], 0.5),
                         "switch_step_ms_p50": _pct([e["step_ms"] for e in mine], 0.5),
                         "precopy_step_ms": [e.get("precopy_step_ms") for e in mine],
                         "chosen": sorted({e["mode"] for e in mine}),
                         "kv_bytes_received_per_rank": mine[0]["kv_bytes_received_per_rank"]
                         if mine else None,
                         "weight_bytes_received_per_rank": mine[0][
                             "weight_bytes_received_per_rank"] if mine else None,
                         "samples": len(mine)}
            if mine:
                rec["kv_bytes_received"] = mine[0]["kv_bytes_received"]
                rec["weight_bytes_received"] = mine[0]["weight_bytes_received"]
                rec["kv_bytes_received_per_rank"] = mine[0]["kv_bytes_received_per_rank"]
                rec["kv_op"], rec["weight_op"] = mine[0]["kv_op"], mine[0]["weight_op"]
        live_mode = "auto" if "auto" in rec else "background"
        base = "cold" if "cold" in rec else "blocking"  # the baseline: cold when measured
        if live_mode in rec and base in rec:
            live, block = rec[live_mode]["overhead_p50_ms"], rec[base]["overhead_p50_ms"]
            rec["live_mode"], rec["baseline_mode"] = live_mode, base
            rec["live_p50_pct_of_ready_step"] = rec[live_mode]["pct_of_ready_interval_p50"]
            rec["live_vs_blocking_reduction_pct"] = 100 * (1 - live / block) if block > 0 else None
            moved = max(k + w for k, w in zip(
                rec.get("kv_bytes_received_per_rank", [0]),
                [rec.get("weight_bytes_received", 0) // args.tp] * args.tp))
            # the transfer's device time where events timed it, else the workers' host time
            ms = rec[base]["transfer_device_ms_p50"]
            if ms != ms:  # nan: not timed on the device
                ms = rec[base]["worker_switch_ms_p50"]
            if base == "cold":  # what the baseline moved, not what the live switch did
                moved = max(k + w for k, w in zip(rec[base]["kv_bytes_received_per_rank"],
                                                  rec[base]["weight_bytes_received_per_rank"]))
            rec["transfer_GBps"] = moved / ms / 1e6 if ms > 0 and moved else None
            rec["link_GBps"] = link_gbps
            print(f"{src:>3} -> {dst:<3}  {live_mode} p50 {live:8.2f} ms "
                  f"({rec['live_p50_pct_of_ready_step']:.2f}% of ready)  {base} p50 "
                  f"{block:8.2f} ms", flush=True)
        directions.append(rec)
    result = {
        "benchmark": "switch_overhead", "method": "paper App. F.2 (interval vs target-ready)",
        "tp": args.tp, "backend": args.backend, "dtype": args.dtype, "layers": args.layers,
        "batch": args.batch, "prompt_len": args.prompt_len, "rounds": args.rounds,
        "date": datetime.date.today().isoformat(), "machine": platform.node(),
        "cpu_count": os.cpu_count(), "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if args.backend == "cuda" else "cpu",
        "ready_step_ms": ready, "directions": directions, "link": link,
    }
    if args.backend == "cpu":
        result["note"] = "CPU figures (Triton interpreter + gloo) are recorded, not claimed"
    if all("live_p50_pct_of_ready_step" in d for d in directions):
        result["median_live_overhead_pct"] = statistics.median(
            d["live_p50_pct_of_ready_step"] for d in directions)
    return result


if __name__ == "__main__":
    sys.exit(main())
