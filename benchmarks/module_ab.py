"""Same-process A/B of a kernel change: an earlier version of a ``kernels_triton`` module, read
from a file, against the tree's, swapped in between timings (old and new interleaved, best of
three), on decode layers (``decode_programs.py``'s shapes; a layer = 8 a CUDA graph under one
plan) or the DSA decode layer (``dsa_kernels.py``, batch 16). One process and interleaved runs
keep the two sides on the same clocks and allocations: differences of ~1% are readable.

``--swap MODULE:NAME`` is what changes: ``NAME`` in ``MODULE``'s namespace is replaced by the
old file's ``NAME`` (or by the old module itself where ``NAME`` is a module there). Keyword
arguments the old function does not take are dropped (a new parameter passed by the caller).
A change across modules takes ``--old`` / ``--swap`` pairs, repeated in the same order.

    git show HEAD~1:kernels_triton/lse_merge.py > /tmp/old_lse_merge.py
    python3 benchmarks/module_ab.py --old /tmp/old_lse_merge.py \
        --swap splash.kernels_triton.mla_decode:_merge_into --heads 16 --fp8 \
        --shapes "1x128K + 63x1K,64x4K" --out ab.json
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import inspect
import sys
import types

import torch
from _results import save_json  # noqa: E402  (benchmarks/ is on sys.path)
from _timing import bench_both
from decode_configs import paged_problem
from decode_layers import layer_ms
from decode_programs import SHAPES
from dsa_kernels import decode_layer

import splash.kernels_triton as K


def _old_value(old: types.ModuleType, current):
    """What replaces ``current``: the old module, or its function of the same name (taking
    only the keyword arguments it knows)."""
    if isinstance(current, types.ModuleType):
        return old
    fn = getattr(old, current.__name__)
    if not inspect.isfunction(current):  # a kernel (launched as kernel[grid](...))
        return fn
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return fn

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return fn(*args, **{k: v for k, v in kwargs.items() if k in params})
    return call


def swapper(old_path: str, swap: str):
    """``use(tag)`` puts the old ("old") or the tree's ("new") value in place."""
    module_name, name = swap.split(":")
    target = importlib.import_module(module_name)  # the module, not a same-named attribute
    stem = old_path.rsplit("/", 1)[-1].removesuffix(".py")
    spec = importlib.util.spec_from_file_location(f"splash.kernels_triton.ab_{stem}", old_path)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    values = {"new": getattr(target, name)}
    values["old"] = _old_value(old, values["new"])

    def use(tag: str) -> None:
        setattr(target, name, values[tag])
    return use


def _compare(run, use, reference=None) -> dict:
    got, times = {}, {"old": [], "new": []}
    for tag in times:
        use(tag)
        got[tag] = run()[0].float()
    for _ in range(3):
        for tag in times:
            use(tag)
            times[tag].append(run.ms())
    use("new")
    row = {**{f"ms_{t}": round(min(v), 4) for t, v in times.items()},
           "runs_ms": {t: [round(x, 4) for x in v] for t, v in times.items()},
           "max_diff_old_new": float((got["old"] - got["new"]).abs().max())}
    if reference is not None:
        row.update({f"err_{t}": float((got[t] - reference).abs().max()) for t in got})
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, action="append",
                    help="the earlier version of the module, a file (repeatable)")
    ap.add_argument("--swap", required=True, action="append",
                    help="MODULE:NAME replaced by the old file's (one per --old)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--shapes", default="64x4K", help="decode_programs.py's shape names")
    ap.add_argument("--dsa", help="instead: DSA layers HEADS:CONTEXT[,...] (batch 16)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/module_ab.py needs a GPU")
    if len(args.old) != len(args.swap):
        sys.exit("module_ab.py: give one --swap for each --old")
    K.set_value_checks(False)
    dev = torch.device("cuda")
    uses = [swapper(old, swap) for old, swap in zip(args.old, args.swap)]

    def use(tag: str) -> None:
        for one in uses:
            one(tag)
    kind = "fp8" if args.fp8 else "bf16"
    rows = []
    if args.dsa:
        for item in args.dsa.split(","):
            heads, context = (int(x) for x in item.split(":"))
            gen = torch.Generator(device=dev).manual_seed(0)
            t = decode_layer(dev, gen, kind, heads, 16, context)

            def run(t=t):
                return t.sparse(t.topk(t.scores()))
            run.ms = lambda run=run: bench_both(run)["ms"]
            rows.append({"dsa": True, "heads": heads, "context": context, "kv": kind,
                         **_compare(run, use)})
            print(rows[-1], flush=True)
    else:
        wanted = args.shapes.split(",")
        for name, lens in SHAPES:
            if name not in wanted:
                continue
            run, _ = paged_problem(args.heads, lens, dev, args.fp8)
            run.ms = lambda run=run: layer_ms(run)
            rows.append({"shape": name, "heads": args.heads, "kv": kind,
                         **_compare(run, use, run.reference().float())})
            print(rows[-1], flush=True)
            torch.cuda.empty_cache()
    save_json(args.out, {"benchmark": "module_ab", "old": args.old, "swap": args.swap,
                         "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
