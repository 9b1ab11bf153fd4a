"""`splash demo` (`make demo`): a tiny random DeepSeek-architecture model on 2 CPU workers runs
an RL-rollout-shaped batch — many short generations and a few long ones starting together —
with layout="auto", then with each fixed layout on the same trace. Prints a progress bar with
the current layout, a summary table, and writes a PNG of the layout timeline. No downloads.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from typing import Any

from splash import envs
from splash.llm import LLM
from splash.model.presets import make_model
from splash.sampling_params import SamplingParams

LAYOUTS = ["tp", "dp", "cp", "dop"]


def rollout_trace(seed: int, n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of 32-64 tokens; output lengths heavy-tailed: most short, a quarter long."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, 200) for _ in range(rng.randint(32, 64))] for _ in range(n)]
    lengths = [3 if i % 4 else 16 for i in range(n)]
    return prompts, [SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True)
                     for k in lengths]


def _checkpoint() -> str:
    path = os.path.join(envs.get("SPLASH_CACHE_DIR"), "demo-deepseek-v3-tiny")
    if not os.path.exists(os.path.join(path, "config.json")):
        print(f"building a tiny random DeepSeek-V3-architecture checkpoint in {path}")
        make_model(path, "deepseek-v3", layers=2, seed=0, scale="tiny")
    return path


def _bar(done: int, total: int, layout: str, step: int) -> None:
    width = 30
    filled = int(width * done / max(total, 1))
    sys.stderr.write(f"\r  [{'#' * filled}{'.' * (width - filled)}] {done}/{total} requests  "
                     f"step {step:3d}  layout {layout:>3}")
    sys.stderr.flush()


def run_trace(path: str, layout: str, tp_size: int, prompts, params) -> dict[str, Any]:
    with LLM(path, tp_size=tp_size, backend="cpu", layout=layout) as llm:
        eng = llm.engine
        print(f"{layout:>4}: workers ready; running {len(prompts)} requests", file=sys.stderr)
        ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
        tokens: dict[str, list[int]] = {}
        timeline = []
        t0 = time.perf_counter()
        while eng.has_unfinished():
            s0 = time.perf_counter()
            current = eng.layout
            outs = eng.step()
            timeline.append({"step": eng.step_count, "layout": eng.layout if outs else current,
                             "start_s": s0 - t0, "ms": (time.perf_counter() - s0) * 1e3})
            for o in outs:
                if o.finished:
                    tokens[o.request_id] = o.token_ids
            _bar(len(tokens), len(ids), eng.layout, eng.step_count)
        elapsed = time.perf_counter() - t0
        sys.stderr.write("\n")
        stats = llm.stats()
    generated = sum(len(t) for t in tokens.values())
    return {"layout": layout, "elapsed_s": elapsed, "tokens_per_s": generated / elapsed,
            "tokens": [tokens[i] for i in ids], "timeline": timeline,
            "switches": stats["switches"], "decisions": stats["policy_decisions"]}


def _table(auto: dict, fixed: list[dict]) -> str:
    lines = ["", "time per layout (auto run):"]
    per: dict[str, float] = {}
    for t in auto["timeline"]:
        per[t["layout"]] = per.get(t["layout"], 0.0) + t["ms"] / 1e3
    lines += [f"  {name:>4}: {sec:6.1f} s" for name, sec in per.items()]
    lines.append("live switches:")
    for s in auto["switches"]:
        lines.append(f"  step {s['step']:3d}  {s['from']:>3} -> {s['to']:<3}  KV {s['kv_op']:<10} "
                     f"weights {s['weight_op']:<10} received {s['kv_bytes_received'] + s['weight_bytes_received']:>8} B"
                     f"  switch cost {s['overhead_ms']:.1f} ms")
    if not auto["switches"]:
        lines.append("  (none: the policy kept its first layout)")
    lines.append("throughput on the same trace (CPU interpreter figures, not GPU claims):")
    for r in [auto, *fixed]:
        lines.append(f"  {r['layout']:>4}: {r['tokens_per_s']:6.2f} tokens/s  ({r['elapsed_s']:.1f} s)")
    same = all(r["tokens"] == auto["tokens"] for r in fixed)
    lines.append(f"greedy tokens identical across all runs: {'yes' if same else 'NO'}")
    return "\n".join(lines)


def _plot(auto: dict, out_png: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    colors = {"tp": "tab:blue", "dp": "tab:orange", "cp": "tab:green", "dop": "tab:red"}
    fig, ax = plt.subplots(figsize=(9, 2.4))
    for t in auto["timeline"]:
        ax.barh(0, t["ms"] / 1e3, left=t["start_s"], color=colors[t["layout"]], height=0.6)
    for s in auto["switches"]:
        start = next((t["start_s"] for t in auto["timeline"] if t["step"] == s["step"] + 1), 0)
        ax.axvline(start, color="black", lw=1, ls="--")
    ax.set_yticks([])
    ax.set_xlabel("seconds")
    ax.set_title("SPLASH demo: layout over time (layout=auto)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, list(colors), ncol=4, loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return True


def demo_main(args: Any) -> int:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    path = _checkpoint()
    n = args.requests or 12
    prompts, params = rollout_trace(seed=0, n=n)
    out_dir = args.out or os.path.join(envs.get("SPLASH_CACHE_DIR"), "demo")
    os.makedirs(out_dir, exist_ok=True)
    print(f"SPLASH demo: {n} rollout requests on {args.tp_size} CPU workers, layout=auto, then "
          "each fixed layout on the same trace")
    auto = run_trace(path, "auto", args.tp_size, prompts, params)
    fixed = [run_trace(path, name, args.tp_size, prompts, params) for name in LAYOUTS]
    print(_table(auto, fixed))
    png = os.path.join(out_dir, "layout_timeline.png")
    if _plot(auto, png):
        print(f"layout timeline: {png}")
    with open(os.path.join(out_dir, "demo.json"), "w") as f:
        json.dump({"auto": {k: v for k, v in auto.items() if k != "tokens"},
                   "fixed": [{k: v for k, v in r.items() if k not in ("tokens", "timeline")}
                             for r in fixed]}, f, indent=1)
    return 0
