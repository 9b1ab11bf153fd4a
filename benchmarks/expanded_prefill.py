"""One prefill chunk's attention, absorbed (``mla_extend``) against expanded (keys and values
from the latent rows through W_UK / W_UV, then ``mha_extend``), on one GPU at DeepSeek-V3 dims
(L 512, R 64, nope 128, v 128), bf16, 128 or 16 heads (T = 1 or 8 of TP), one request.

Both sides include what their form adds around the kernel: absorbed, the query's product with
W_UK and the output's with W_UV; expanded, the gather of the history rows and the two expansion
products. ``TFLOPs_absorbed_equiv`` counts the absorbed form's FLOPs for both, so the ratio of
the two is the speed-up a serving step sees. Decides ``SPLASH_MHA_PREFILL``'s default.

    python3 benchmarks/expanded_prefill.py --out benchmarks/results/h200/expanded_prefill.json
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch
from _results import save_json  # noqa: E402  (benchmarks/ is on sys.path)
from _timing import bench, ceilings

from splash.kernels_triton import kv_gather, mla_extend
from splash.kernels_triton.mha_extend import mha_extend

L, R, NOPE, DV, PAGE = 512, 64, 128, 128, 64


CONFIGS = [{"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
           {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
           {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
           {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3},
           {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2}]


def one(heads: int, chunk: int, prefix: int, dtype=torch.bfloat16, sweep: bool = False) -> dict:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    T = prefix + chunk
    pages = -(-T // PAGE)
    kv = torch.randn(pages, PAGE, L + R, device=dev, dtype=dtype, generator=g)
    table = torch.randperm(pages, device=dev, generator=g).to(torch.int32)[None, :]
    seq_lens = torch.tensor([T], dtype=torch.int32, device=dev)
    q_start = torch.tensor([0, chunk], dtype=torch.int32, device=dev)
    k_start = torch.zeros(1, dtype=torch.int32, device=dev)
    w_uk = torch.randn(heads, NOPE, L, device=dev, dtype=dtype, generator=g) * 0.05
    w_uv = torch.randn(heads, DV, L, device=dev, dtype=dtype, generator=g) * 0.05
    q = torch.randn(chunk, heads, NOPE + R, device=dev, dtype=dtype, generator=g)
    pos = torch.arange(T, device=dev)
    slots = (table[0].long()[pos // PAGE] * PAGE + pos % PAGE)
    scale = (NOPE + R) ** -0.5

    def absorbed():
        q_abs = torch.empty(chunk, heads, L + R, device=dev, dtype=dtype)
        torch.bmm(q[..., :NOPE].transpose(0, 1), w_uk, out=q_abs.transpose(0, 1)[..., :L])
        q_abs[..., L:] = q[..., NOPE:]
        o, _ = mla_extend(q_abs, kv, table, seq_lens, q_start, scale, L)
        return torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2))

    def expanded(config=None):
        rows = kv_gather(kv, slots)
        k = (rows[:, :L] @ w_uk.reshape(heads * NOPE, L).t()).view(T, heads, NOPE)
        v = (rows[:, :L] @ w_uv.reshape(heads * DV, L).t()).view(T, heads, DV)
        return mha_extend(q, k, rows[:, L:].contiguous(), v, q_start, k_start, seq_lens, scale,
                          config=config)[0]

    a = absorbed().transpose(0, 1).float()
    e = expanded().float()
    err = float((a - e).abs().max() / a.abs().max().clamp_min(1e-6))
    ms_a, ms_e = bench(absorbed), bench(expanded)
    pairs = chunk * prefix + chunk * (chunk + 1) / 2
    flops = 2 * heads * pairs * (L + R + L)  # the absorbed form's, for both
    rec = {"heads": heads, "chunk": chunk, "prefix": prefix, "dtype": str(dtype),
           "ms_absorbed": round(ms_a, 3), "ms_expanded": round(ms_e, 3),
           "speedup": round(ms_a / ms_e, 2), "rel_err": err,
           "TFLOPs_absorbed_equiv_absorbed": round(flops / ms_a / 1e9, 1),
           "TFLOPs_absorbed_equiv_expanded": round(flops / ms_e / 1e9, 1)}
    if sweep:  # mha_extend's launch configs, the whole expanded side timed with each
        rec["sweep"] = []
        for cfg in CONFIGS:
            try:
                ms = bench(functools.partial(expanded, cfg))
                rec["sweep"].append({**cfg, "ms_expanded": round(ms, 3)})
            except Exception as e:  # a config that does not fit shared memory is a result
                rec["sweep"].append({**cfg, "error": f"{type(e).__name__}: {e}"[:200]})
    return rec


def records(heads: int, chunk: int, prefixes: tuple[int, ...], ceil: dict) -> list[dict]:
    """``kernel_bench``'s ``prefill_expanded`` records of a chunk at ``prefixes``, beside the
    same run's ceilings ``ceil``."""
    out = []
    for prefix in prefixes:
        row = one(heads, chunk, prefix)
        rec = {"kernel": "prefill_expanded", "heads": heads, "batch": 1,
               "context": prefix + chunk, "chunk": chunk, "prefix": prefix, "dtype": "bf16",
               "ms": row["ms_expanded"], "ms_absorbed_form": row["ms_absorbed"],
               "TFLOPs": row["TFLOPs_absorbed_equiv_expanded"],
               "TFLOPs_note": "the absorbed form's FLOPs over the expanded form's time",
               "ceiling_matmul_TFLOPs": round(ceil["matmul_TFLOPs"], 1),
               "ceiling_copy_GBps": round(ceil["copy_GBps"], 1)}
        out.append(rec)
        print(rec, flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default="128:8192:0,128:8192:24576,128:2048:0,128:512:8192,"
                    "16:8192:0,16:8192:24576")
    ap.add_argument("--no-sweep", action="store_true", help="the launcher's default config only")
    ap.add_argument("--out", default="benchmarks/results/h200/expanded_prefill.json")
    args = ap.parse_args()
    rows = []
    for p in args.points.split(","):
        h, c, pre = (int(x) for x in p.split(":"))
        rows.append(one(h, c, pre, sweep=not args.no_sweep))
        print(rows[-1], flush=True)
    save_json(args.out, {"benchmark": "expanded_prefill", "rows": rows,
                         "ceilings": ceilings(torch.device("cuda"))})
    return 0


if __name__ == "__main__":
    sys.exit(main())
