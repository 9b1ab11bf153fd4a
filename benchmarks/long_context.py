"""One long request end to end: by default on a DSA (DeepSeek-V3.2-shaped) checkpoint, a
128K-token prompt prefilled in chunks, then decoded with the lightning indexer and top-k sparse
MLA; ``--preset deepseek-v3`` serves a dense one (the prefill form ``SPLASH_MHA_PREFILL`` picks,
recorded beside the figures, decides its TTFT).

Builds a random checkpoint of the preset's dims (full hidden/attention/indexer dims, ``--layers`` layers,
``--experts`` routed experts, O(1) activations) with transformers on the GPU, serves one prompt
of ``--context`` tokens and records prefill time (TTFT), time per output token, the KV pages the
request took and the GPU memory peak. The decode run resends the prompt, so it reuses the
prompt's pages from the prefix cache: its time per token is an upper bound (one page of prefill
included).

    python3 benchmarks/long_context.py --out benchmarks/results/h200/long_context.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))

from _results import save_json  # noqa: E402
from multi_gpu import build  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--preset", default="deepseek-v3.2", help="a splash.model.presets name")
    ap.add_argument("--out", default="benchmarks/results/h200/long_context.json")
    args = ap.parse_args()
    from splash import LLM, SamplingParams

    path = build(f"/tmp/splash-{args.preset}-{args.layers}l", args.layers, args.experts,
                 args.preset)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, 1000, (args.context,), generator=g).tolist()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    out: dict = {"preset": args.preset, "layers": args.layers, "experts": args.experts,
                 "context": args.context,
                 "SPLASH_MHA_PREFILL": os.environ.get("SPLASH_MHA_PREFILL", "auto")}
    t0 = time.perf_counter()
    with LLM(path, max_model_len=args.context + args.max_tokens + 64) as llm:
        out["startup_s"] = time.perf_counter() - t0
        out["index_topk"] = json.load(open(os.path.join(path, "config.json"))).get("index_topk")
        llm.generate([prompt[:256]], SamplingParams(max_tokens=4))  # warm-up
        t1 = time.perf_counter()
        first = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
        out["ttft_s"] = time.perf_counter() - t1
        t2 = time.perf_counter()
        res = llm.generate([prompt], params)
        total = time.perf_counter() - t2
        out["e2e_s"] = total
        out["tpot_ms_upper"] = 1e3 * total / args.max_tokens
        out["first_token_matches"] = first[0].token_ids[0] == res[0].token_ids[0]
        out["output_tokens"] = len(res[0].token_ids)
        st = llm.stats()
        out["stats"] = {k: st.get(k) for k in ("num_steps", "graph_steps", "kv_pages_total",
                                               "kv_pages_used", "prefix_cache_hit_tokens")}
    out["gpu_peak_gib"] = torch.cuda.max_memory_allocated() / (1 << 30)
    print(out, flush=True)
    save_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
