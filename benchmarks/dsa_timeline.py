"""Per-kernel GPU timeline of a DSA decode layer's selection and attention (the indexer's
scores, the top-k passes, sparse MLA and its merge), replayed from one CUDA graph: each
kernel's start (from the first kernel's) and duration under torch's profiler, and the replay's
time per step, at batch 16, index_topk 2048, V3.2 dims (``dsa_kernels.py``), 16 and 128 heads,
32K and 128K context. With programmatic dependent launch a kernel's programs may start before
the one before it ends (they wait inside), so durations overlap. ``--contexts`` / ``--heads`` /
``--batch`` pick other shapes; with several contexts each kernel's duration is also fitted as
a fixed part plus a part per token of context (least squares over the contexts, ``fit``),
which says how much of the layer no tuning of a kernel's streaming can remove.

    python benchmarks/dsa_timeline.py --out timeline.json [--contexts 8192,32768,131072]
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


def fit(runs: dict[int, dict]) -> dict:
    """Per kernel (by its place in the layer, where every context runs the same kernels) and
    for the step: microseconds = fixed + per_32k x context / 32K, least squares."""
    contexts = sorted(runs)
    names = [[k["name"] for k in runs[c]["kernels"]] for c in contexts]
    x = torch.tensor(contexts, dtype=torch.float64) / 32768

    def line(ys: list[float]) -> dict:
        y = torch.tensor(ys, dtype=torch.float64)
        slope = float(((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum())
        return {"fixed_us": round(float(y.mean()) - slope * float(x.mean()), 2),
                "per_32k_us": round(slope, 2)}
    out = {"step": line([runs[c]["ms_per_step"] * 1e3 for c in contexts])}
    if all(n == names[0] for n in names):
        out["kernels"] = [{"name": n, **line([runs[c]["kernels"][i]["us"] for c in contexts])}
                          for i, n in enumerate(names[0])]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--contexts", default="32768,131072")
    parser.add_argument("--heads", default="16,128")
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/dsa_timeline.py needs a GPU")
    K.set_value_checks(False)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    contexts = [int(c) for c in args.contexts.split(",")]
    result: dict = {"batch": args.batch, "index_topk": TOPK, "shapes": {}, "fit": {}}
    for heads in (int(h) for h in args.heads.split(",")):
        runs = {}
        for context in contexts:
            name = f"{heads}h-bf16-{context}"
            layer = decode_layer(dev, gen, "bf16", heads, args.batch, context)
            runs[context] = timeline(lambda ly=layer: ly.sparse(ly.topk(ly.scores())))
            result["shapes"][name] = runs[context]
            print(name, runs[context]["ms_per_step"], "ms", flush=True)
            for k in runs[context]["kernels"]:
                print(f"    {k['name'][:40]:40s} start {k['start_us']:8.2f} us  {k['us']:7.2f} us")
            layer = None
            torch.cuda.empty_cache()
        if len(contexts) > 2:
            result["fit"][f"{heads}h"] = fit(runs)
            print(f"{heads}h fit", result["fit"][f"{heads}h"], flush=True)
    save_json(args.out, result)


if __name__ == "__main__":
    main()
