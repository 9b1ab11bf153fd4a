"""MLA decode for many heads over an e4m3 cache on Hopper, in Gluon: the value product turned
around (``outᵀ = Vᵀ · pᵀ``) so that the fp8 tile feeds both products as it landed, with no
widened copy of it in shared memory (``config["fp8_register_values"]``; q read in e4m3,
``config["fp8_query"]``). Above 32 heads on CUDA ``mla_decode_heads_fp8_ws`` serves first
(``config["fp8_widen_worker"]``, 1.15-1.29x this kernel's speed on an H100 at 128 heads);
this one serves with that off.

A program is one warpgroup holding 32 heads of one request over one split of the balanced
plan, two programs an SM (101 KB of shared memory, 255 registers each), so that one's softmax
runs under the other's products. Each program first quantises its 32 heads of the 16-bit q to
e4m3 with a scale a head into shared memory (``mla_decode_gluon_tiles._quantised_query``,
``quantise_rows``' operations) instead of a launch before the kernel (H200, same run: 64 x 4K
0.219 -> 0.217 ms, 128 x 1K 0.130 -> 0.123, 8 x 32K and 2 x 128K -0.6%, 64 x 32K and one 128K
among 63 of 1K +0.7%; ``decode_heads_fp8_query_in_kernel.json``). Per 64-token tile, staged by
TMA two tiles ahead (e4m3, 36 KB a stage):

    scoresᵀ (64 tokens, 32 heads) = tile · q8ᵀ     fp8 x fp8; q quantised to e4m3 with a
                                                   scale a head
    outᵀ    (512, 32 heads)      += Vᵀ · pᵀ         two accumulators of 256 latent rows; Vᵀ
                                                   widened to fp16 in registers (the product's
                                                   A operand), pᵀ fp16 in shared memory

The softmax runs down each head's column of tokens; p (times the rows' scales) goes to shared
memory (double-buffered: one barrier a tile, after its stores). The value operand comes from
the stage in 8-byte loads: a thread reads 8 latent columns of its tokens, exactly the elements
its A fragments hold once the rows of an accumulator half are ordered so: row
``r = 64 j + 16 w + 8 h + g`` (j the MMA's M repetition, w the warp, g the lane's group, h its
upper half) holds latent column ``c0 + 64 w + 8 g + 2 j + h``. The bytes then need only pairing
across two tokens and PTX's e4m3x2 -> f16x2 conversion (``_widened`` of the few-head fp8
kernel, whose module explains the relabelling). The rows go back to column order once, through
shared memory, before the output stores.

The accumulators take 128 of a thread's registers, so the operand is widened a quarter tile
(16 tokens) and half the rows at a time, each piece multiplied before the next is widened
(the other program on the SM fills the gaps; keeping a piece in flight while widening the next
spills and is 7-12% slower); tile i + 1's scores are issued behind tile i's first pieces. A
split's last partial tile zeroes its operand's columns past the range (a page's unused rows may
hold NaN). H200, a layer against the previous form (two warpgroups on 64 heads, one program an
SM) in the same run (``decode_heads_fp8_tried_s29.json``): 64 x 4K 0.224 -> 0.221 ms, 64 x 32K
1.526 -> 1.526, 8 x 32K 0.232 -> 0.214, 2 x 128K 0.230 -> 0.216, 128 x 1K 0.147 -> 0.131,
64 over 1K-32K 1.530 -> 1.453, one 128K among 63 of 1K 2.05 -> 1.80. That form ran both
warpgroups through the softmax and then the products in lockstep: Nsight Compute put its
tensor pipe at 26% busy and issue at 28%, and five changes to it were each slower (its softmax
under the last quarter, a lazy rescale, operands widened a quarter early, the scales by TMA,
the value product in e4m3 with a 4 x 4 byte transpose; the same JSON).
"""

from __future__ import annotations

import torch

from splash.kernels_triton import mla_decode_gluon_tiles as tiles
from splash.kernels_triton.pdl import pdl

try:  # Gluon ships with Triton 3.5 and later
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from splash.kernels_triton.mla_decode_gluon_tiles import (
        _plan_item,
        _quantised_query,
        _query_buffers,
        _query_rows,
        _refill,
        _start_copies,
        _tile_rows,
    )
    from splash.kernels_triton.mla_decode_tokens_fp8 import (
        _issue_scores,
        _widened,
    )
    from splash.kernels_triton.mla_decode_tokens_gluon import (
        _finish,
        _normalised,
        _softmax_columns,
    )
except ImportError:  # pragma: no cover - an older Triton: the Triton kernels serve
    gluon = None

BH = 32  # heads a program


if gluon is not None:
    BN = gl.constexpr(tiles.BN)
    GQ = gl.constexpr(BH)
    LH = gl.constexpr(256)  # latent rows an accumulator half

    @gluon.jit
    def _half_quarter(kn, pb, acc, valid, a_layout: gl.constexpr, T_LO: gl.constexpr,
                      C_LO: gl.constexpr):
        """outᵀ rows of latent columns [C_LO, C_LO + 256) += Vᵀ · pᵀ over the tile's tokens
        [T_LO, T_LO + 16), issued; rows ``64 j + 16 w + 8 h + g`` <-> column
        ``C_LO + 64 w + 8 g + 2 j + h`` (a partial tile's tokens past ``valid`` as 0)."""
        ld: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [0, 4], [1, 0], [8, 0]],
            lane_bases=[[2, 0], [4, 0], [0, 8], [0, 16], [0, 32]],
            warp_bases=[[0, 64], [0, 128]], block_bases=[], shape=[16, 256])
        x = kn.slice(T_LO, 16, dim=0).slice(C_LO, 256, dim=1).load(ld)
        y = _widened(x.to(gl.int8, bitcast=True))
        y = gl.permute(gl.reshape(y, [16, 4, 8, 4, 2]), (3, 1, 4, 2, 0))  # (j, w, h, g, token)
        v = gl.convert_layout(gl.reshape(y, [256, 16]), a_layout, assert_trivial=True)
        if valid < BN:
            tok = T_LO + gl.arange(0, 16, layout=gl.SliceLayout(0, a_layout))
            v = gl.where((tok < valid)[None, :], v, gl.zeros_like(v))
        return warpgroup_mma(v, pb.slice(T_LO, 16, dim=0), acc, is_async=True)

    @gluon.jit
    def _later_quarters(kn, pb, tok_a, tok_b, valid, a_layout: gl.constexpr):
        """Quarters 1-3 of both halves, a piece widened once the one before is done."""
        for qt in gl.static_range(1, 4):
            acc_a = warpgroup_mma_wait(0, deps=(tok_a,))
            tok_a = _half_quarter(kn, pb, acc_a, valid, a_layout, 16 * qt, 0)
            acc_b = warpgroup_mma_wait(0, deps=(tok_b,))
            tok_b = _half_quarter(kn, pb, acc_b, valid, a_layout, 16 * qt, LH)
        return tok_a, tok_b

    @gluon.jit
    def _columns_back(acc):
        """An accumulator half's rows back in column order (relabelled: ``_finish`` converts
        them once for its stores)."""
        acc = gl.permute(gl.reshape(acc, [4, 4, 2, 8, GQ]), (1, 3, 0, 2, 4))  # (w, g, j, h)
        return gl.reshape(acc, [LH, GQ])

    @gluon.jit
    def _mla_decode_fp8_heads_kernel(
        kn_desc, kr_desc,  # TMA: kv (pages * PS, L + R)
        scale_ptr,  # (pages, PS) fp32
        bt_ptr,  # (N, max_pages) int
        o_ptr, o_low_ptr, lse_ptr, out_ptr, lse_out_ptr, plan_ptr,  # as the tokens kernels'
        q_ptr, stride_qn, stride_qh,  # q (N, H, L + R), 16-bit, quantised here
        qk_scale, H, N,
        stride_sp, stride_ss,
        stride_btn, stride_btp,
        stride_os, stride_oh,
        stride_ls,
        stride_outn, stride_outh,
        stride_lon,
        L: gl.constexpr, R: gl.constexpr, PS: gl.constexpr, LOW_SPLITS: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        hg = gl.program_id(0)
        pid = gl.program_id(1)
        n, count, start, end = _plan_item(plan_ptr, pid, N, 1, 0, 0, False)
        if n < N:
            mma_s: gl.constexpr = gl.NVMMADistributedLayout(
                version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, GQ, 32])
            mma: gl.constexpr = gl.NVMMADistributedLayout(
                version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, GQ, 16])
            a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma,
                                                         k_width=2)
            qn_s, qr_s = _query_buffers(GQ, L, R)
            kn_s = gl.allocate_shared_memory(kn_desc.dtype, [2, BN, L], kn_desc.layout)
            kr_s = gl.allocate_shared_memory(kr_desc.dtype, [2, BN, R], kr_desc.layout)
            p_s = gl.allocate_shared_memory(
                gl.float16, [2, BN, GQ],
                gl.NVMMASharedLayout.get_default_for([BN, GQ], gl.float16))
            bars = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
            bt_row = bt_ptr + n.to(gl.int64) * stride_btn
            h0 = hg * GQ
            tiles = (end - start + BN - 1) // BN
            xn, xr = _query_rows(q_ptr + n.to(gl.int64) * stride_qn + h0 * stride_qh,
                                 stride_qh, H - h0, L, R, GQ, num_warps)
            _start_copies(None, None, kn_desc, kr_desc, None, 0, bt_row, stride_btp, start,
                          tiles, qn_s, qr_s, kn_s, kr_s, None, bars, bt_ptr, 0, 0, end, L, PS,
                          False, num_warps)
            qs = _quantised_query(xn, xr, qn_s, qr_s, L, R, num_warps)
            qsc = gl.convert_layout(qs, gl.SliceLayout(0, mma_s)) * qk_scale

            acc_a = gl.zeros((LH, GQ), gl.float32, layout=mma)
            acc_b = gl.zeros((LH, GQ), gl.float32, layout=mma)
            m_i = gl.full((GQ,), float("-inf"), gl.float32, layout=gl.SliceLayout(0, mma_s))
            l_i = gl.zeros((GQ,), gl.float32, layout=gl.SliceLayout(0, mma_s))
            rows_m = gl.arange(0, BN, layout=gl.SliceLayout(1, mma_s))
            s = gl.zeros((BN, GQ), gl.float32, layout=mma_s)
            ks = gl.zeros((BN,), gl.float32, layout=gl.SliceLayout(1, mma_s))
            ok = rows_m < 0
            if tiles > 0:
                s = warpgroup_mma_wait(0, deps=(_issue_scores(qn_s, qr_s, kn_s, kr_s, bars, s,
                                                              0),))
                off, ok = _tile_rows(bt_row, stride_btp, start, end, rows_m, stride_sp,
                                     stride_ss, PS, False)
                ks = gl.load(scale_ptr + off, mask=ok, other=0.0)
            for i in range(tiles):
                st = i % 2
                t0 = start + i * BN
                kn = kn_s.index(st)
                sm = gl.where(ok[:, None], s * ks[:, None] * qsc[None, :], float("-inf"))
                p, alpha, m_i, l_i = _softmax_columns(sm, m_i, l_i, False)
                pb = p_s.index(st)
                pb.store((p * ks[:, None]).to(gl.float16))
                fence_async_shared()
                gl.thread_barrier()
                alpha_o = gl.convert_layout(alpha, gl.SliceLayout(0, mma))
                tok_a = _half_quarter(kn, pb, acc_a * alpha_o[None, :], end - t0, a_layout, 0, 0)
                acc_b = acc_b * alpha_o[None, :]
                acc_a = warpgroup_mma_wait(0, deps=(tok_a,))
                tok_b = _half_quarter(kn, pb, acc_b, end - t0, a_layout, 0, LH)
                if i + 1 < tiles:
                    s_tok = _issue_scores(qn_s, qr_s, kn_s, kr_s, bars, s, i + 1)
                    tok_a, tok_b = _later_quarters(kn, pb, tok_a, tok_b, end - t0, a_layout)
                    s = warpgroup_mma_wait(0, deps=(s_tok,))
                    off, ok = _tile_rows(bt_row, stride_btp, t0 + BN, end, rows_m, stride_sp,
                                         stride_ss, PS, False)
                    ks = gl.load(scale_ptr + off, mask=ok, other=0.0)
                else:
                    tok_a, tok_b = _later_quarters(kn, pb, tok_a, tok_b, end - t0, a_layout)
                acc_a = warpgroup_mma_wait(0, deps=(tok_a,))
                acc_b = warpgroup_mma_wait(0, deps=(tok_b,))
                _refill(kn_desc, kr_desc, None, bt_row, stride_btp, t0 + 2 * BN, end, kn,
                        kr_s.index(st), None, bars.index(st), i + 2 < tiles, bt_ptr, 0, 0, L,
                        PS, False, num_warps)
            for i in gl.static_range(3):
                mbarrier.invalidate(bars.index(i))
            m_o = gl.convert_layout(m_i, gl.SliceLayout(0, mma))
            l_o = gl.convert_layout(l_i, gl.SliceLayout(0, mma))
            res_a, lse = _normalised(acc_a, m_o, l_o)
            res_b = _normalised(acc_b, m_o, l_o)[0]
            _finish(_columns_back(res_a), lse, n, pid, count, H - h0,
                    o_ptr + h0 * stride_oh, o_low_ptr + h0 * stride_oh, lse_ptr + h0,
                    out_ptr + h0 * stride_outh, lse_out_ptr + h0, stride_os, stride_oh,
                    stride_ls, stride_outn, stride_outh, stride_lon, LH, GQ, LOW_SPLITS, mma,
                    num_warps)
            _finish(_columns_back(res_b), lse, n, pid, count, H - h0,
                    o_ptr + h0 * stride_oh + LH, o_low_ptr + h0 * stride_oh + LH,
                    lse_ptr + h0, out_ptr + h0 * stride_outh + LH, lse_out_ptr + h0,
                    stride_os, stride_oh, stride_ls, stride_outn, stride_outh, stride_lon, LH,
                    GQ, LOW_SPLITS, mma, num_warps)


def serves(kv: torch.Tensor, cfg: dict) -> bool:
    """Whether this kernel takes an e4m3 cache where the many-head Gluon kernel would
    (``mla_decode_heads_gluon.usable``, q read in e4m3): ``config["fp8_register_values"]``."""
    return gluon is not None and kv.dtype == torch.float8_e4m3fn \
        and bool(cfg.get("fp8_query")) and bool(cfg.get("fp8_register_values"))


def launch(q: torch.Tensor, kv: torch.Tensor, scale: torch.Tensor, block_table: torch.Tensor,
           o_part: torch.Tensor, o_low: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor,
           lse: torch.Tensor, items: torch.Tensor, qk_scale: float, low: int) -> None:
    """Head groups of 32 x one program per plan item (``mla_decode``'s balanced plan, made for
    64-head groups at one program an SM: two 32-head programs an SM), each program quantising
    its 32 heads of q to e4m3 with a scale a head."""
    N, H, D = q.shape
    L = out.shape[2]
    q = q if q.stride(2) == 1 else q.contiguous()
    rows_kv = tiles.kv_rows(kv)
    _mla_decode_fp8_heads_kernel[((H + BH - 1) // BH, items.shape[0])](
        tiles.descriptor(rows_kv, L), tiles.descriptor(rows_kv, D - L),
        scale, block_table, o_part, o_low, lse_part, out, lse, items,
        q, q.stride(0), q.stride(1), qk_scale, H, N,
        scale.stride(0), scale.stride(1), block_table.stride(0), block_table.stride(1),
        o_part.stride(0), o_part.stride(2), lse_part.stride(0), out.stride(0), out.stride(1),
        lse.stride(0), L=L, R=D - L, PS=kv.shape[1], LOW_SPLITS=low, num_warps=4,
        launch_pdl=pdl(q.device),
    )
