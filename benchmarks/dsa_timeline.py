"""Per-kernel GPU timeline of a DSA decode layer's selection and attention (the indexer's
scores, the top-k passes, sparse MLA and its merge), replayed from one CUDA graph: each
kernel's start (from the first kernel's) and duration under torch's profiler, and the replay's
time per step, at batch 16, index_topk 2048, V3.2 dims (``dsa_kernels.py``), 16 and 128 heads,
32K and 128K context. With programmatic dependent launch a kernel's programs may start before
the one before it ends (they wait inside), so durations overlap.

    python benchmarks/dsa_timeline.py --out timeline.json
"""

from __future__ import annotations

import argparse
import sys

import torch
from _results import save_json  # noqa: E402  (benchmarks/ is on sys.path)
from _timing import captured
from dsa_kernels import TOPK, decode_layer
from torch.profiler import ProfilerActivity, profile

import splash.kernels_triton as K


def timeline(layer, replays: int = 5) -> dict:
    graph, ms = captured(layer)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                    key=lambda e: e.time_range.start)
    last = events[-(len(events) // replays):]  # the last replay's kernels
    t0 = last[0].time_range.start
    return {"ms_per_step": round(ms, 4),
            "kernels": [{"name": e.name, "start_us": round(e.time_range.start - t0, 2),
                         "us": round(e.time_range.end - e.time_range.start, 2)} for e in last]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/dsa_timeline.py needs a GPU")
    K.set_value_checks(False)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    result: dict = {"batch": 16, "index_topk": TOPK, "shapes": {}}
    for heads in (16, 128):
        for context in (32768, 131072):
            name = f"{heads}h-bf16-{context}"
            layer = decode_layer(dev, gen, "bf16", heads, 16, context)
            result["shapes"][name] = timeline(lambda ly=layer: ly.sparse(ly.topk(ly.scores())))
            print(name, result["shapes"][name]["ms_per_step"], "ms", flush=True)
            for k in result["shapes"][name]["kernels"]:
                print(f"    {k['name'][:40]:40s} start {k['start_us']:8.2f} us  {k['us']:7.2f} us")
            torch.cuda.empty_cache()
    save_json(args.out, result)


if __name__ == "__main__":
    main()
