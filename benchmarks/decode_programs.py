"""MLA decode launch configs in the balanced plan (programs an SM, the partials' dtype): a
layer's ms and TFLOP/s (8 layers a CUDA graph under one plan, interleaved, the best of two) for uniform
and mixed batches and each config (``--configs``; ``--error``: with its largest error against
the torch reference, fp64 math rounded to the output's dtype), with what the compiler gave each
kernel (registers, spills, shared memory, programs an SM that fit).

    python3 benchmarks/decode_programs.py --out benchmarks/results/h200/decode_programs.json \
        [--fp8] [--configs '[{}, {"programs_per_sm": 1}]']
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from _resources import compiled_resources  # noqa: E402  (benchmarks/ is on sys.path)
from _results import save_json
from decode_configs import D, L, paged_problem
from decode_layers import layer_ms
from dsa_timeline import timeline

from splash import kernels_triton as K

SPREAD = [1024 + (i * 7919) % 31745 for i in range(64)]  # lengths spread over 1K-32K
SHAPES = [("64x4K", [4096] * 64), ("64x32K", [32768] * 64), ("16x128K", [131072] * 16),
          ("128x1K", [1024] * 128), ("64x1K", [1024] * 64), ("8x4K", [4096] * 8),
          ("64 x 1K-32K", SPREAD), ("128 x 256-2K", [256 + (i * 97) % 1793 for i in range(128)]),
          ("1x128K + 63x1K", [131072] + [1024] * 63),
          ("8x32K", [32768] * 8), ("2x128K", [131072] * 2)]  # kernels.json's 128-head shapes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--error", action="store_true",
                    help="also each config's largest error against the torch reference")
    ap.add_argument("--configs", default='[{}, {"programs_per_sm": 1}, {"programs_per_sm": 3}]')
    ap.add_argument("--shapes", help="comma-separated shape names to run (default: all)")
    ap.add_argument("--timeline", action="store_true",
                    help="also each shape's per-kernel timeline of one layer (first config)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/decode_programs.py needs a GPU")
    K.set_value_checks(False)
    dev = torch.device("cuda")
    configs = json.loads(args.configs)
    rows, timelines = [], {}
    wanted = set(args.shapes.split(",")) if args.shapes else {name for name, _ in SHAPES}
    for name, lens in SHAPES:
        if name not in wanted:
            continue
        run, nbytes = paged_problem(args.heads, lens, dev, args.fp8)
        ref = run()[0].float()
        exact = run.reference().float() if args.error else None
        times: dict[int, list[float]] = {i: [] for i in range(len(configs))}
        failed: dict[int, str] = {}  # a config that does not build (shared memory) is reported
        for _ in range(2):
            for i, cfg in enumerate(configs):
                if i in failed:
                    continue
                try:
                    times[i].append(layer_ms(lambda cfg=cfg, run=run: run(cfg)))
                except Exception as exc:  # noqa: BLE001
                    torch.cuda.synchronize()
                    failed[i] = repr(exc)[:160]
        for i, cfg in enumerate(configs):
            if i in failed:
                rows.append({"shape": name, "config": cfg, "error": failed[i]})
                print(rows[-1], flush=True)
                continue
            got = run(cfg)[0].float()
            same = bool(torch.allclose(got, ref, rtol=2e-2, atol=2e-2))
            ms = min(times[i])
            rows.append({"shape": name, "config": cfg, "ms_layer": round(ms, 4),
                         "GBps": round(nbytes / ms / 1e6, 1),
                         "TFLOPs": round(2 * args.heads * (D + L) * sum(lens) / ms / 1e9, 1),
                         "matches_default": same})
            if exact is not None:  # against the reference (fp64 math, in the output's dtype)
                rows[-1]["max_abs_err"] = float((got - exact).abs().max())
            print(rows[-1], flush=True)
        if args.timeline:  # the plan, the attention kernel, the merge: where the layer goes
            timelines[name] = timeline(lambda run=run: run(configs[0]))
            print(name, timelines[name], flush=True)
        run = ref = None
        torch.cuda.empty_cache()
    save_json(args.out, {"benchmark": "decode_programs", "heads": args.heads,
                         "kv": "fp8" if args.fp8 else "bf16", "rows": rows,
                         **({"timelines": timelines} if timelines else {}),
                         "kernels": compiled_resources(dev)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
