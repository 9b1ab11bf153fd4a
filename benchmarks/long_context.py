"""One long request end to end: by default on a DSA (DeepSeek-V3.2-shaped) checkpoint, a
128K-token prompt prefilled in chunks, then decoded with the lightning indexer and top-k sparse
MLA; ``--preset deepseek-v3`` serves a dense one (the prefill form ``SPLASH_MHA_PREFILL`` picks,
recorded beside the figures, decides its TTFT).

Builds a random checkpoint of the preset's dims (full hidden/attention/indexer dims, ``--layers`` layers,
``--experts`` routed experts, O(1) activations) with transformers on the GPU and serves one prompt
of ``--context`` tokens through the engine's steps, timing each: prefill (TTFT, the chunks'
steps), decode (the median and mean step after the first token), then the same prompt again,
whose pages the prefix cache holds (its first token's time and its decode steps). Also the KV
pages, the GPU memory peak, and a device profile of a few prefill and decode steps (the kernels
that took the time, ``--profile-dir``).

    python3 benchmarks/long_context.py --out benchmarks/results/h200/long_context.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))

from _results import save_json  # noqa: E402
from multi_gpu import build  # noqa: E402


def _run(eng, prompt: list[int], params, profile: tuple[int, int, str] | None = None) -> dict:
    """Step one request to the end: wall ms of every step, split at its first token."""
    req = eng.requests[eng.add_request(prompt, params)]
    steps, first_at, n = [], None, 0
    while eng.has_unfinished():
        if profile is not None and n in profile[:2]:
            eng.profile_steps(3, f"{profile[2]}/{'prefill' if n == profile[0] else 'decode'}")
        t = time.perf_counter()
        eng.step()
        steps.append(1e3 * (time.perf_counter() - t))
        n += 1
        if first_at is None and req.output_token_ids:
            first_at = n
    first_at = first_at or n
    decode = steps[first_at:]
    return {"ttft_s": round(sum(steps[:first_at]) / 1e3, 3), "prefill_steps": first_at,
            "decode_steps": len(decode),
            "decode_ms_median": round(statistics.median(decode), 3) if decode else None,
            "decode_ms_mean": round(statistics.fmean(decode), 3) if decode else None,
            "step_ms": [round(x, 2) for x in steps], "token_ids": list(req.output_token_ids)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--preset", default="deepseek-v3.2", help="a splash.model.presets name")
    ap.add_argument("--out", default="benchmarks/results/h200/long_context.json")
    ap.add_argument("--profile-dir", default=None, help="device profiles of 3 prefill and 3 "
                    "decode steps of the first request (default: beside --out)")
    args = ap.parse_args()
    from splash import LLM, SamplingParams

    path = build(f"/tmp/splash-{args.preset}-{args.layers}l", args.layers, args.experts,
                 args.preset)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, 1000, (args.context,), generator=g).tolist()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    prof_dir = args.profile_dir or os.path.splitext(args.out)[0] + "_profile"
    out: dict = {"preset": args.preset, "layers": args.layers, "experts": args.experts,
                 "context": args.context, "max_tokens": args.max_tokens,
                 "SPLASH_MHA_PREFILL": os.environ.get("SPLASH_MHA_PREFILL", "auto")}
    t0 = time.perf_counter()
    with LLM(path, max_model_len=args.context + args.max_tokens + 64) as llm:
        out["startup_s"] = time.perf_counter() - t0
        out["index_topk"] = json.load(open(os.path.join(path, "config.json"))).get("index_topk")
        llm.generate([prompt[:256]], SamplingParams(max_tokens=4))  # warm-up
        eng = llm.engine
        chunks = max(args.context // 2048, 1)
        out["first"] = _run(eng, prompt, params, (chunks // 2, chunks + 8, prof_dir))
        out["prefix_hit"] = _run(eng, prompt, params)
        out["tokens_match"] = out["first"]["token_ids"] == out["prefix_hit"]["token_ids"]
        st = llm.stats()
        out["stats"] = {k: st.get(k) for k in ("num_steps", "graph_steps", "kv_pages_total",
                                               "kv_pages_used", "prefix_cache_hit_tokens")}
    out["gpu_peak_gib"] = torch.cuda.max_memory_allocated() / (1 << 30)
    out["profiles"] = {}
    for phase in ("prefill", "decode"):
        f = os.path.join(prof_dir, phase, "profile_rank0.json")
        if os.path.exists(f):
            d = json.load(open(f))
            out["profiles"][phase] = {
                "ms_per_step": round(d["ms_per_step"], 3),
                "calls_per_step": d.get("calls_per_step"),
                "kernels": [{"kernel": k["kernel"][:60], "ms_per_step": round(k["ms_per_step"], 3),
                             "calls_per_step": k.get("calls_per_step")}
                            for k in d["kernels"][:12]]}
    print({k: v for k, v in out.items() if k not in ("first", "prefix_hit")}, flush=True)
    for k in ("first", "prefix_hit"):
        print(k, {x: y for x, y in out[k].items() if x != "step_ms"}, flush=True)
    save_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
