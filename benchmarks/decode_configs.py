"""Few-head MLA decode: launch configs × split counts of ``mla_decode`` (bf16 KV) against the
copy bandwidth, and the head-group kernel's tiles, warps and stages with fp8 KV (fp16
products).

    python3 benchmarks/decode_configs.py --out benchmarks/results/h200/decode_configs.json

Every time is a CUDA-graph replay (what a decode step pays); splits ``None`` is the launcher's
wave model. Outputs are checked against the default's.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys

import torch
from _results import save_json  # noqa: E402  (benchmarks/ is on sys.path)
from _timing import ceilings
from triton.testing import do_bench_cudagraph

from splash import kernels_triton as K

L, PS, D = 512, 64, 576
CONFIGS = [{}, {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
           {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
           {"BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
           {"BLOCK_N": 128, "num_warps": 8, "num_stages": 2},
           {"BLOCK_N": 32, "num_warps": 4, "num_stages": 4}]


def paged_problem(heads: int, lens: list[int], dev: torch.device, fp8: bool = False):
    """One decode row per request of ``lens`` over a paged cache in random page order:
    ``(run(cfg=None, splits=None) -> mla_decode's result, KV bytes read)``."""
    g = torch.Generator(device=dev).manual_seed(0)
    need = [-(-n // PS) for n in lens]
    pages = sum(need)
    scale = None
    if fp8:
        kv = torch.empty(pages, PS, D, device=dev, dtype=torch.float8_e4m3fn)
        kv.view(torch.uint8).random_(0, 0x7E, generator=g)  # finite e4m3 bit patterns
        scale = torch.rand(pages, PS, device=dev, generator=g) * 0.01 + 0.005
    else:
        kv = torch.randn(pages, PS, D, device=dev, dtype=torch.bfloat16, generator=g)
    perm = torch.randperm(pages, device=dev, generator=g).to(torch.int32)
    table = torch.zeros((len(lens), max(need)), dtype=torch.int32, device=dev)
    start = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[start:start + n]
        start += n
    q = torch.randn(len(lens), heads, D, device=dev, dtype=torch.bfloat16, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)

    def run(cfg=None, splits=None):
        return K.mla_decode(q, kv, table, seq_lens, D ** -0.5, L, kv_scale=scale,
                            num_splits=splits, config=cfg or None)
    run.reference = lambda: K.mla_decode_ref(q, kv, table, seq_lens, D ** -0.5, L,
                                             kv_scale=scale)[0]
    return run, sum(lens) * (kv.element_size() * D + (4 if fp8 else 0))


def problem(heads: int, batch: int, context: int, dev: torch.device, fp8: bool = False):
    """``batch`` requests of ``context`` tokens each (see ``paged_problem``)."""
    return paged_problem(heads, [context] * batch, dev, fp8)


def sweep(dev: torch.device) -> list[dict]:
    rows = []
    for heads, batch, context in [(16, 64, 4096), (16, 64, 32768), (16, 16, 131072),
                                  (16, 128, 1024), (16, 1, 131072)]:
        run, nbytes = problem(heads, batch, context, dev)
        ref = run()[0].float()
        for cfg in CONFIGS:
            for splits in (None, 1, 2, 4, 8, 16, 32):
                ok = bool(torch.allclose(run(cfg, splits)[0].float(), ref, atol=2e-2, rtol=2e-2))
                ms = do_bench_cudagraph(functools.partial(run, cfg, splits), rep=40)
                rows.append({"H": heads, "B": batch, "T": context, "cfg": cfg, "splits": splits,
                             "ms": round(ms, 4), "ok": ok, "GBps": round(nbytes / ms / 1e6)})
                print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    return rows


def fp8_sweep(dev: torch.device) -> list[dict]:
    rows = []
    for heads, batch, context in [(16, 64, 32768), (16, 64, 4096)]:
        run, nbytes = problem(heads, batch, context, dev, fp8=True)
        ref = run()[0].float()
        configs = [None] + [{"BLOCK_N": n, "num_warps": w, "num_stages": st,
                             "fp8_fp16": True}
                            for n, w, st in itertools.product((32, 64), (4, 8), (2, 3))]
        configs.append({"BLOCK_N": 64, "num_warps": 8, "num_stages": 2,
                        "fp8_fp16": False})
        for cfg in configs:
            ok = bool(torch.allclose(run(cfg)[0].float(), ref, atol=3e-2, rtol=3e-2))
            ms = do_bench_cudagraph(functools.partial(run, cfg), rep=30)
            rows.append({"H": heads, "B": batch, "T": context, "cfg": cfg, "ms": round(ms, 4),
                         "ok": ok, "GBps": round(nbytes / ms / 1e6)})
            print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/h200/decode_configs.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/decode_configs.py needs a GPU")
    K.set_value_checks(False)
    dev = torch.device("cuda")
    save_json(args.out, {"benchmark": "decode_configs", "rows": sweep(dev),
                         "fp8_sweep": fp8_sweep(dev),
                         "ceilings": ceilings(dev)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
