"""What a user's first requests pay after start-up: Triton compilations mid-serving.

Starts the engine (its warm-up included), then serves requests one at a time whose shapes the
warm-up did not see: prompt lengths of 1 page, a multiple of 16 pages, an odd page count, a
batch of mixed lengths, long contexts that widen the block table (DSA: past ``index_topk``,
where the indexer and top-k run). For each it records the wall time and the kernels Triton
compiled during it (counted in every kernel's compile cache), then serves the same request
again: the second time is what the request costs without compiling. Each architecture runs in
a process of its own (set ``TRITON_CACHE_DIR`` to an empty folder for a cold machine).

    python3 benchmarks/first_requests.py --out benchmarks/results/h200/first_requests.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))

from _results import save_json  # noqa: E402
from multi_gpu import build  # noqa: E402


def serve(llm, prompts: list[list[int]], max_tokens: int) -> tuple[float, dict[str, int]]:
    from splash import SamplingParams
    from splash.kernels_triton.compiled import compiled_binaries

    before = compiled_binaries()
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                         ignore_eos=True))
    secs = time.perf_counter() - t0
    after = compiled_binaries()
    return secs, {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)}


def run(path: str, arch: str, lengths: list[list[int]], max_model_len: int,
        max_tokens: int) -> dict:
    from splash import LLM

    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    rows = []
    with LLM(path, max_model_len=max_model_len) as llm:
        startup = time.perf_counter() - t0
        for group in lengths:
            prompts = [torch.randint(10, 1000, (n,), generator=g).tolist() for n in group]
            first, new = serve(llm, prompts, max_tokens)
            again, _ = serve(llm, [p[::-1] for p in prompts], max_tokens)  # no prefix hits
            rows.append({"prompt_lens": group, "first_s": round(first, 3),
                         "again_s": round(again, 3), "compiled": new})
            print(arch, rows[-1], flush=True)
    return {"arch": arch, "startup_s": round(startup, 1), "max_model_len": max_model_len,
            "requests": rows,
            "compiles_after_startup": sum(sum(r["compiled"].values()) for r in rows),
            "stall_s": round(sum(max(r["first_s"] - r["again_s"], 0) for r in rows), 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--long", type=int, default=65536,
                    help="the longest prompt (dense models: past 16K at 128 heads, the expanded "
                         "prefill's history runs in pieces)")
    ap.add_argument("--archs", default="deepseek-v3,deepseek-v3.2")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--label", default="", help="recorded with the results (e.g. the commit)")
    ap.add_argument("--out", default="benchmarks/results/h200/first_requests.json")
    args = ap.parse_args()
    archs = args.archs.split(",")
    if len(archs) > 1:  # each in a process of its own: none starts with another's binaries
        results = []
        for arch in archs:
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "run.json")
                subprocess.run([sys.executable, __file__, "--archs", arch, "--out", out,
                                "--layers", str(args.layers), "--experts", str(args.experts),
                                "--long", str(args.long), "--max-tokens", str(args.max_tokens)],
                               check=True)
                with open(out) as f:
                    results += json.load(f)["runs"]
    else:
        page = 64
        short = [[5], [16 * page], [7 * page + 3], [40, 3 * page, 999, 2500]]
        arch = archs[0]
        path = build(f"/tmp/splash-{arch}-{args.layers}l", args.layers, args.experts, arch)
        lengths = short + ([[4096], [20000], [args.long]] if arch.endswith(".2")
                           else [[8192], [args.long]])
        longest = max(max(g) for g in lengths)
        results = [run(path, arch, lengths, longest + args.max_tokens + page, args.max_tokens)]
    save_json(args.out, {"benchmark": "first_requests", "label": args.label,
                         "layers": args.layers, "experts": args.experts, "runs": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
