"""End-to-end: the same trace with layout="auto" and with each fixed layout, side by side in one
run — throughput, TTFT/TPOT p50/p99, switches, and a PNG of auto's layout timeline.

    python benchmarks/end_to_end.py --trace rollout --n 16 --tp 2 \
        --out benchmarks/results/cpu/end_to_end_rollout.json

On CPU, traces are scaled down (--max-prompt/--max-output) and figures are not GPU claims.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

import torch
from _results import save_json  # noqa: E402  (benchmarks/ is on sys.path)

sys.path.insert(0, os.path.dirname(__file__))

from splash.planning.workloads import get_trace, scaled  # noqa: E402

LAYOUTS = ["auto", "tp", "dp", "cp", "dop"]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(round(q * (len(xs) - 1))), len(xs) - 1)] if xs else float("nan")


def run(path: str, layout: str, trace, args) -> dict:
    from splash import LLM, SamplingParams

    g = torch.Generator().manual_seed(args.seed)
    with LLM(path, tp_size=args.tp, backend=args.backend, layout=layout) as llm:
        eng = llm.engine
        pending = sorted(enumerate(trace), key=lambda x: x[1].arrival_s)
        arrive, first, done, ntok = {}, {}, {}, {}
        timeline = []
        t0 = time.perf_counter()
        while pending or eng.has_unfinished():
            now = time.perf_counter() - t0
            while pending and pending[0][1].arrival_s * args.time_scale <= now:
                i, r = pending.pop(0)
                prompt = torch.randint(2, 200, (r.prompt_len,), generator=g).tolist()
                sp = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
                rid = eng.add_request(prompt, sp, request_id=f"t{i}")
                arrive[rid] = now
            if not eng.has_unfinished():
                time.sleep(0.01)
                continue
            s0 = time.perf_counter()
            outs = eng.step()
            s1 = time.perf_counter()
            timeline.append({"t": s0 - t0, "ms": (s1 - s0) * 1e3, "layout": eng.layout})
            for o in outs:
                first.setdefault(o.request_id, s1 - t0)
                if o.finished:
                    done[o.request_id], ntok[o.request_id] = s1 - t0, len(o.token_ids)
        elapsed = time.perf_counter() - t0
        stats = llm.stats()
    ttft = [first[r] - arrive[r] for r in done]
    tpot = [(done[r] - first[r]) / (ntok[r] - 1) for r in done if ntok[r] > 1]
    return {"layout": layout, "elapsed_s": elapsed, "tokens": sum(ntok.values()),
            "tokens_per_s": sum(ntok.values()) / elapsed,
            "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99),
            "tpot_p50_s": _pct(tpot, 0.5), "tpot_p99_s": _pct(tpot, 0.99),
            "switches": [{k: s[k] for k in ("step", "from", "to", "overhead_ms")}
                         for s in stats["switches"]],
            "timeline": timeline}


def plot(result: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"tp": "tab:blue", "dp": "tab:orange", "cp": "tab:green", "dop": "tab:red"}
    fig, ax = plt.subplots(figsize=(9, 2.6))
    for row, r in enumerate(result["runs"]):
        for t in r["timeline"]:
            ax.barh(row, t["ms"] / 1e3, left=t["t"], color=colors[t["layout"]], height=0.7)
    ax.set_yticks(range(len(result["runs"])), [r["layout"] for r in result["runs"]])
    ax.set_xlabel("seconds")
    ax.set_title(f"layout timeline, trace {result['trace']} (T={result['tp']})")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trace", default="rollout")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--max-prompt", type=int, default=96)
    ap.add_argument("--max-output", type=int, default=32)
    ap.add_argument("--time-scale", type=float, default=0.0, help="arrival seconds x this")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--ckpt", default=None, help="checkpoint dir (default: a tiny random V3)")
    ap.add_argument("--out", default="benchmarks/results/cpu/end_to_end_rollout.json")
    args = ap.parse_args()
    if args.backend == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from splash.model.presets import make_model

    path = args.ckpt or f"/tmp/splash-e2e-bench-{args.layers}"
    if not os.path.exists(os.path.join(path, "config.json")):
        make_model(path, "deepseek-v3", layers=args.layers, seed=0, scale="tiny")
    trace = scaled(get_trace(args.trace, seed=args.seed, n=args.n), args.max_prompt,
                   args.max_output)
    runs = []
    for layout in LAYOUTS:
        r = run(path, layout, trace, args)
        print(f"{layout:>4}: {r['tokens_per_s']:7.2f} tokens/s  TTFT p50 {r['ttft_p50_s']:.2f} s  "
              f"TPOT p50 {r['tpot_p50_s']:.3f} s  switches {len(r['switches'])}", flush=True)
        runs.append(r)
    best_fixed = max(r["tokens_per_s"] for r in runs[1:])
    result = {"benchmark": "end_to_end", "trace": args.trace, "n": args.n, "tp": args.tp,
              "backend": args.backend, "date": datetime.date.today().isoformat(),
              "machine": platform.node(), "cpu_count": os.cpu_count(),
              "torch": torch.__version__,
              "auto_vs_best_fixed": runs[0]["tokens_per_s"] / best_fixed, "runs": runs,
              "note": "CPU figures (Triton interpreter + gloo) are not GPU claims"}
    save_json(args.out, result)
    plot(result, args.out.replace(".json", ".png"))
    print(f"auto / best fixed = {result['auto_vs_best_fixed']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
