"""Switch overhead per direction, live (layer-pipelined) vs blocking.

Overhead = the switching step's time − the destination's ready step time on the same batch
(the step right after, which computes in the destination without switching).
A batch of decoding requests walks an Eulerian circuit of the 12 directions ``--rounds`` times,
switching every other step, once with live and once with blocking switches.

    python benchmarks/switch_overhead.py --tp 2 --out benchmarks/results/cpu/switch_overhead.json

On CPU (interpreter + gloo) figures are recorded, not claimed; on GPUs pass --backend cuda.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys

import torch
from _results import save_json  # noqa: E402  (benchmarks/ is on sys.path)

CIRCUIT = ["tp", "dp", "tp", "cp", "tp", "dop", "dp", "cp", "dp", "dop", "cp", "dop", "tp"]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(round(q * (len(xs) - 1))), len(xs) - 1)] if xs else float("nan")


def measure(path: str, tp: int, backend: str, mode: str, rounds: int, batch: int,
            prompt_len: int, dtype: str) -> list[dict]:
    from splash import LLM, SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, 200, (batch, prompt_len), generator=g).tolist()
    plan = []
    step = 4  # let the prefill finish first
    for _ in range(rounds):
        for dst in CIRCUIT[1:]:
            plan.append((step, dst))
            step += 2
    params = SamplingParams(max_tokens=step + 4, temperature=0.0, ignore_eos=True)
    with LLM(path, tp_size=tp, backend=backend, layout=CIRCUIT[0], switch_mode=mode,
             dtype=dtype, max_num_batched_tokens=batch * prompt_len) as llm:
        llm.generate(prompts, params, layout_plan=plan)
        return llm.stats()["switches"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--out", default="benchmarks/results/cpu/switch_overhead.json")
    args = ap.parse_args()
    if args.backend == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from splash.model.presets import make_model

    path = args.ckpt or f"/tmp/splash-switch-bench-{args.layers}"
    if not os.path.exists(os.path.join(path, "config.json")):
        make_model(path, "deepseek-v3", layers=args.layers, seed=0, scale="tiny")
    dtype = args.dtype or ("fp32" if args.backend == "cpu" else "bf16")
    runs = {mode: measure(path, args.tp, args.backend, mode, args.rounds, args.batch,
                          args.prompt_len, dtype) for mode in ("live", "blocking")}
    directions = []
    for src, dst in zip(CIRCUIT, CIRCUIT[1:]):
        rec: dict = {"from": src, "to": dst}
        for mode, entries in runs.items():
            mine = [e for e in entries
                    if (e["from"], e["to"]) == (src, dst) and "step_minus_ready_ms" in e]
            over = [e["step_minus_ready_ms"] for e in mine]
            ready = [e["ready_step_ms"] for e in mine]
            rec[mode] = {"overhead_p50_ms": _pct(over, 0.5), "overhead_p95_ms": _pct(over, 0.95),
                         "ready_step_p50_ms": _pct(ready, 0.5), "samples": len(mine)}
            if mine:
                rec["kv_bytes_received"] = mine[0]["kv_bytes_received"]
                rec["weight_bytes_received"] = mine[0]["weight_bytes_received"]
                rec["kv_op"], rec["weight_op"] = mine[0]["kv_op"], mine[0]["weight_op"]
        live, block = rec["live"]["overhead_p50_ms"], rec["blocking"]["overhead_p50_ms"]
        rec["live_p50_pct_of_ready_step"] = 100 * live / rec["live"]["ready_step_p50_ms"]
        rec["live_vs_blocking_reduction_pct"] = 100 * (1 - live / block) if block > 0 else None
        directions.append(rec)
        print(f"{src:>3} -> {dst:<3}  live p50 {live:8.2f} ms  blocking p50 {block:8.2f} ms  "
              f"({rec['live_p50_pct_of_ready_step']:.1f}% of the ready step)")
    result = {
        "benchmark": "switch_overhead", "tp": args.tp, "backend": args.backend, "dtype": dtype,
        "batch": args.batch, "prompt_len": args.prompt_len, "rounds": args.rounds,
        "date": datetime.date.today().isoformat(), "machine": platform.node(),
        "cpu_count": os.cpu_count(), "torch": torch.__version__,
        "note": "CPU figures (Triton interpreter + gloo) are recorded, not claimed",
        "directions": directions,
        "median_live_overhead_pct_of_step": statistics.median(
            d["live_p50_pct_of_ready_step"] for d in directions),
    }
    save_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
