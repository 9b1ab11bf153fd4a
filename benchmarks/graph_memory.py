"""What the start-up CUDA graphs take on one GPU: an engine at T=1 captures every layout's
decode graphs (4 layouts x the batch buckets), then serves a few tokens from them; per model,
the memory the capture reserved (the engine's ``cuda_graph_mib``) beside the graph reserve the
KV pool was sized with. Models: the tests' tiny V3 (fp32) and a V3 of full dimensions with 4
layers and 8 routed experts (bf16, written once to /tmp).

    python3 benchmarks/graph_memory.py --out benchmarks/results/h100/graph_memory.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")]


def measure(name: str, path: str, **kw) -> dict:
    from splash import LLM, SamplingParams

    t = time.time()
    with LLM(path, tp_size=1, backend="cuda", **kw) as llm:
        start = llm.stats()
        outs = llm.generate([[5, 6, 7, 8]] * 3,
                            SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        after = llm.stats()
    return {"model": name, "graphs": start["cuda_graphs_captured"],
            "graph_mib": round(start["cuda_graph_mib"], 1),
            "graph_reserve_mib": round(start["memory"]["graph_reserve_gib"] * 1024, 1),
            "capture_s": round(start["cuda_graph_capture_s"], 2),
            "graph_steps": after["graph_steps"], "tokens": outs[0].token_ids,
            "wall_s": round(time.time() - t, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("benchmarks/graph_memory.py needs a GPU")
    import multi_gpu
    from _results import save_json
    from tiny_models import checkpoint

    rows = [measure("tiny V3, fp32", checkpoint("v3"), dtype="fp32", page_size=8),
            measure("V3 dimensions, 4 layers, 8 experts, bf16",
                    multi_gpu.build("/tmp/splash-v3-4l-8e", 4, 8))]
    for row in rows:
        print(row, flush=True)
    save_json(args.out, {"benchmark": "graph_memory", "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
