"""Native fp8 products in few-head MLA decode, tried against bf16 KV: a minimal split-KV
head-group kernel (one-page tiles, partials left unmerged) in four modes, on an H200 graph-timed.

    MODE 0  bf16 KV, bf16 products (the reference speed)
    MODE 1  fp8 KV, both products e4m3 x e4m3: q quantised per head, p per tile (scale folded
            into the running accumulator)
    MODE 2  fp8 KV, scores e4m3 x e4m3, value product with the tile widened to fp16
    MODE 3  fp8 KV, both products fp16 (q scaled per head, the tile widened)

Errors are against an fp32 reference over the dequantised fp8 KV (MODE 0 reads the unquantised
rows, so its error is the fp8 rounding itself). Result: no fp8 mode beats the production fp8
kernel, let alone bf16 (Triton 3.6 moves fp8 value tiles through shared memory to transpose them).

    python3 benchmarks/fp8_products.py --out benchmarks/results/h200/fp8_products.json
"""
import argparse
import functools
import sys

import torch
import triton
import triton.language as tl
from _results import save_json  # noqa: E402  (benchmarks/ is on sys.path)
from triton.testing import do_bench_cudagraph

L, R, PS = 512, 64, 64


@triton.jit
def _k(q_ptr, qs_ptr, kv_ptr, ks_ptr, bt_ptr, o_ptr, lse_ptr, seq_len, qk_scale, MAXP,
       H: tl.constexpr, L: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr,
       BLOCK_N: tl.constexpr, PS: tl.constexpr, MODE: tl.constexpr, NS: tl.constexpr):
    pid_s = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_h = tl.arange(0, BLOCK_H)
    mh = offs_h < H
    offs_l = tl.arange(0, L)
    offs_r = tl.arange(0, R)
    qb = q_ptr + pid_n * H * (L + R) + offs_h[:, None] * (L + R)
    q_nope = tl.load(qb + offs_l[None, :], mask=mh[:, None], other=0.0)
    q_rope = tl.load(qb + L + offs_r[None, :], mask=mh[:, None], other=0.0)
    qs = tl.load(qs_ptr + pid_n * H + offs_h, mask=mh, other=1.0)
    split = seq_len // NS
    start = pid_s * split
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, L), tl.float32)
    c_prev = 1.0
    for t0 in range(start, start + split, BLOCK_N):
        page = tl.load(bt_ptr + pid_n * MAXP + t0 // PS).to(tl.int64)
        rows = page * PS + (t0 % PS) + tl.arange(0, BLOCK_N)
        kn = tl.load(kv_ptr + rows[:, None] * (L + R) + offs_l[None, :])
        kr = tl.load(kv_ptr + rows[:, None] * (L + R) + L + offs_r[None, :])
        if MODE == 0:
            qk = tl.dot(q_nope, tl.trans(kn))
            qk = tl.dot(q_rope, tl.trans(kr), qk) * qk_scale
        else:
            rs = tl.load(ks_ptr + rows)
            if MODE == 3:
                qk = tl.dot(q_nope, tl.trans(kn.to(tl.float16)))
                qk = tl.dot(q_rope, tl.trans(kr.to(tl.float16)), qk)
            else:
                qk = tl.dot(q_nope, tl.trans(kn))
                qk = tl.dot(q_rope, tl.trans(kr), qk)
            qk = qk * qs[:, None] * (rs * qk_scale)[None, :]
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MODE == 0:
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(kn.dtype), kn, acc)
        elif MODE == 1:
            c = 256.0 / tl.max(rs, 0)
            acc = acc * (alpha * (c / c_prev))[:, None]
            acc = tl.dot((p * (rs * c)[None, :]).to(tl.float8e4nv), kn, acc)
            c_prev = c
        else:
            acc = acc * alpha[:, None]
            acc = tl.dot((p * rs[None, :]).to(tl.float16), kn.to(tl.float16), acc)
        m_i = m_new
    acc = acc / c_prev
    out = acc / l_i[:, None]
    ob = o_ptr + (pid_s * tl.num_programs(1) + pid_n) * H * L
    tl.store(ob + offs_h[:, None] * L + offs_l[None, :], out, mask=mh[:, None])
    tl.store(lse_ptr + (pid_s * tl.num_programs(1) + pid_n) * H + offs_h,
             m_i + tl.log2(l_i), mask=mh)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/h200/fp8_products.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/fp8_products.py needs a GPU")
    dev = torch.device("cuda")
    res = []
    for H, B, T in [(16, 64, 32768), (16, 16, 131072), (16, 64, 4096), (128, 8, 32768)]:
        g = torch.Generator(device=dev).manual_seed(0)
        pages = B * T // PS
        kv = torch.randn(pages, PS, L + R, device=dev, generator=g) * 2
        table = torch.randperm(pages, device=dev, generator=g).to(torch.int32).view(B, -1)
        q = torch.randn(B, H, L + R, device=dev, generator=g)
        scale = (L + R) ** -0.5 * 1.4426950408889634
        amax = kv.abs().amax(-1).clamp_min(1e-6)
        ks = (amax / 448).contiguous()
        kv8 = (kv / ks[..., None]).to(torch.float8_e4m3fn)
        deq = kv8.float() * ks[..., None]
        qa = q.abs().amax(-1).clamp_min(1e-6)
        qs = (qa / 448).contiguous()
        q8 = (q / qs[..., None]).to(torch.float8_e4m3fn)
        # reference: fp8 KV dequantised, q unquantised, fp32
        idx = (table.long()[:, :, None] * PS + torch.arange(PS, device=dev)).view(B, -1)
        kvr = deq.view(-1, L + R)[idx]  # (B, T, D)
        s = torch.einsum("bhd,btd->bht", q, kvr) * (L + R) ** -0.5
        ref = torch.einsum("bht,btl->bhl", s.softmax(-1), kvr[..., :L])
        del kvr, s
        kvb = kv.to(torch.bfloat16)
        qb = q.to(torch.bfloat16)
        NS = max(1, 264 // B) if H == 16 else max(1, 132 // B)
        for mode, BH, BN, nw, st in [(0, 16, 64, 4, 2), (0, 64, 64, 4, 2), (1, 16, 64, 4, 2),
                                     (1, 64, 64, 4, 2), (1, 64, 64, 8, 2), (1, 16, 128, 4, 2),
                                     (2, 16, 64, 4, 2), (3, 16, 64, 4, 2), (3, 64, 64, 4, 2)]:
            if H == 128 and BH == 16:
                continue
            o = torch.empty(NS, B, H, L, device=dev)
            lse = torch.empty(NS, B, H, device=dev)
            qq = qb if mode == 0 else (q8 if mode in (1, 2) else (q / qs[..., None]).half())
            kk = kvb if mode == 0 else kv8
            grid = (NS, B, triton.cdiv(H, BH))
            if grid[2] > 1:
                continue

            run = functools.partial(
                _k[grid[:2]], qq, qs, kk, ks, table, o, lse, T, scale, table.shape[1], H=H, L=L,
                R=R, BLOCK_H=BH, BLOCK_N=BN, PS=PS, MODE=mode, NS=NS, num_warps=nw,
                num_stages=st)
            try:
                run()
                torch.cuda.synchronize()
                w = torch.softmax(lse * 0.6931471805599453, 0)[..., None]
                out = (o * w).sum(0)
                err = float((out - ref).abs().max() / ref.abs().max())
                ms = do_bench_cudagraph(run, rep=50)
            except Exception as e:
                res.append({"H": H, "B": B, "T": T, "mode": mode, "BH": BH, "BN": BN,
                            "err": str(e)[:300]})
                print(res[-1], flush=True)
                continue
            nbytes = B * T * ((L + R) * (2 if mode == 0 else 1) + (0 if mode == 0 else 4))
            res.append({"H": H, "B": B, "T": T, "mode": mode, "BH": BH, "BN": BN, "nw": nw,
                        "ms": round(ms, 4), "GBps": round(nbytes / ms / 1e6),
                        "tokens_per_us": round(B * T / ms / 1e3), "rel_err": round(err, 4)})
            print(res[-1], flush=True)
        del kv, kv8, deq, kvb
        torch.cuda.empty_cache()
    save_json(args.out, {"benchmark": "fp8_products", "rows": res})
    return 0


if __name__ == "__main__":
    sys.exit(main())
