"""The dimension-chunked form of ``mla_decode``'s head-group kernel (``config["dim_chunks"]``,
the CUDA default for few heads). Same grid, arguments and outputs as ``_mla_decode_kernel``; see
``mla_decode.py``'s docstring for the design they share.

With few heads the products run on ``mma`` (M = 16 heads), whose A operand lives in registers:
the head-group kernel keeps the whole query (16 x 576) in every warp across the loop, which with
the accumulator slice and the key fragments exceeds 255 registers (fp8 KV: 600 B of spills) and
caps a Hopper SM at two programs. Here the latent dims are split into four column chunks: each
KV chunk is loaded once and feeds both products (a quarter of the scores' contraction and a
quarter of the value columns, with an accumulator of its own), and the query is re-read every
tile in the products' dtype (the launcher casts it once), which the compiler pipelines through
shared memory. Offline sm_90 compile (Triton 3.6, 16 heads, fp8 KV, 32-token tiles, 2 stages):
238 registers without spills (168 with 4-108 B of spills under ``maxnreg`` 168, room for three
programs an SM), against 255 registers and 600 B of spills. On an H200 (16 heads, graph-timed,
benchmarks/results/h200/decode_chunks.json): bf16 64 x 4K 0.099 -> 0.088 ms, 64 x 32K 0.617 ->
0.569, 16 x 128K 0.637 -> 0.575, 128 x 1K 0.082 -> 0.066; fp8 64 x 32K 0.90 -> 0.84. The
register cap lost 8-13% (spills), and at 128 heads, whose accumulator dominates, chunks lose.
"""

from __future__ import annotations

import triton
import triton.language as tl

from splash.kernels_triton.mla_decode_kernels import (
    _full_tiles_end,
    _kv_rows,
    _load_tile,
    _softmax_totals,
    _split_bounds,
    _store_out,
    _widen_kv,
)
from splash.kernels_triton.paged_ids import _page_block
from splash.kernels_triton.pdl import pdl_enter

CHUNKS = tl.constexpr(4)  # the latent dims' column chunks (BLOCK_L // CHUNKS columns each)


@triton.jit
def _chunk_scores(qk, q_rows, kv_rows, c: tl.constexpr, mask_h, mask_t, stride_qd, stride_kvd,
                  L: tl.constexpr, BLOCK_L: tl.constexpr, MASK_T: tl.constexpr,
                  IS_FP8: tl.constexpr, FP8_PTX: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Chunk ``c`` of the tile: its KV columns (returned, widened when fp8, for the value
    product) and its share of the scores added to ``qk``."""
    CH: tl.constexpr = BLOCK_L // CHUNKS
    cols = tl.arange(0, CH) + c * CH
    q = tl.load(q_rows + cols[None, :] * stride_qd, mask=mask_h[:, None] & (cols < L)[None, :],
                other=0.0)  # (BLOCK_H, CH)
    kv = _load_tile(kv_rows + cols[None, :] * stride_kvd, mask_t, cols < L, MASK_T,
                    BLOCK_L != L)  # (BLOCK_N, CH)
    if IS_FP8:
        kv = _widen_kv(kv, q.dtype, FP8_PTX)
    return tl.dot(q, tl.trans(kv), qk, input_precision=DOT_PRECISION), kv


@triton.jit
def _value_chunks(p, alpha, kv0, kv1, kv2, kv3, acc0, acc1, acc2, acc3,
                  DOT_PRECISION: tl.constexpr):
    """The value product over the four column chunks: each accumulator rescaled by ``alpha``
    (the online softmax's correction) plus ``p`` times its chunk of the tile."""
    acc0 = tl.dot(p, kv0, acc0 * alpha[:, None], input_precision=DOT_PRECISION)
    acc1 = tl.dot(p, kv1, acc1 * alpha[:, None], input_precision=DOT_PRECISION)
    acc2 = tl.dot(p, kv2, acc2 * alpha[:, None], input_precision=DOT_PRECISION)
    acc3 = tl.dot(p, kv3, acc3 * alpha[:, None], input_precision=DOT_PRECISION)
    return acc0, acc1, acc2, acc3


@triton.jit
def _attend_tile_chunked(
    q_rows, mask_h, m_i, l_i, acc0, acc1, acc2, acc3,
    kv_ptr, scale_ptr, bt_row_ptr, pages, first_page, t0, end, qk_scale,
    stride_qd, stride_btp, stride_kvp, stride_kvs, stride_kvd, stride_sp, stride_ss,
    L: tl.constexpr,
    R: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    MASK_T: tl.constexpr,
    IS_FP8: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8_PTX: tl.constexpr,
    PAGES: tl.constexpr,
):
    """``_attend_tile`` over four column chunks: one KV tile folded into the online softmax of
    the head group, the value accumulator as four (BLOCK_H, BLOCK_L / 4) pieces."""
    row_off, mask_t, row_scale = _kv_rows(scale_ptr, bt_row_ptr, t0, end, stride_btp,
                                          stride_kvp, stride_kvs, stride_sp, stride_ss,
                                          PAGE_SIZE, BLOCK_N, MASK_T, IS_FP8, pages,
                                          first_page, PAGES)
    kv_rows = kv_ptr + row_off[:, None]
    qk = tl.zeros((BLOCK_H, BLOCK_N), tl.float32)
    qk, kv0 = _chunk_scores(qk, q_rows, kv_rows, 0, mask_h, mask_t, stride_qd, stride_kvd, L,
                            BLOCK_L, MASK_T, IS_FP8, FP8_PTX, DOT_PRECISION)
    qk, kv1 = _chunk_scores(qk, q_rows, kv_rows, 1, mask_h, mask_t, stride_qd, stride_kvd, L,
                            BLOCK_L, MASK_T, IS_FP8, FP8_PTX, DOT_PRECISION)
    qk, kv2 = _chunk_scores(qk, q_rows, kv_rows, 2, mask_h, mask_t, stride_qd, stride_kvd, L,
                            BLOCK_L, MASK_T, IS_FP8, FP8_PTX, DOT_PRECISION)
    qk, kv3 = _chunk_scores(qk, q_rows, kv_rows, 3, mask_h, mask_t, stride_qd, stride_kvd, L,
                            BLOCK_L, MASK_T, IS_FP8, FP8_PTX, DOT_PRECISION)
    offs_r = tl.arange(0, BLOCK_R)
    q_rope = tl.load(q_rows + (L + offs_r)[None, :] * stride_qd,
                     mask=mask_h[:, None] & (offs_r < R)[None, :], other=0.0)
    kv_rope = _load_tile(kv_rows + (L + offs_r)[None, :] * stride_kvd, mask_t, offs_r < R,
                         MASK_T, BLOCK_R != R)
    if IS_FP8:
        kv_rope = kv_rope.to(q_rope.dtype)
    qk = tl.dot(q_rope, tl.trans(kv_rope), qk, input_precision=DOT_PRECISION)
    qk = qk * (row_scale * qk_scale)[None, :]  # row_scale: 1.0 without fp8
    if MASK_T:
        qk = tl.where(mask_t[None, :], qk, float("-inf"))
    # every row has seen a visible token by its first tile, so m_new is finite
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IS_FP8:
        p = p * row_scale[None, :]
    acc0, acc1, acc2, acc3 = _value_chunks(p.to(kv0.dtype), alpha, kv0, kv1, kv2, kv3, acc0,
                                           acc1, acc2, acc3, DOT_PRECISION)
    return m_new, l_i, acc0, acc1, acc2, acc3


@triton.jit(do_not_specialize=["num_splits", "stride_btn", "N"])  # vary by step: one binary
def _mla_decode_chunked_kernel(
    q_ptr, kv_ptr, scale_ptr, bt_ptr, seq_lens_ptr, o_ptr, o_low_ptr, lse_ptr, out_ptr,
    lse_out_ptr, plan_ptr, qk_scale, H, num_splits, N,
    stride_qn, stride_qh, stride_qd,
    stride_kvp, stride_kvs, stride_kvd,
    stride_sp, stride_ss,
    stride_btn, stride_btp,
    stride_sl,
    stride_os, stride_on, stride_oh, stride_ol,
    stride_ls, stride_ln, stride_lh,
    stride_outn, stride_outh, stride_outl,
    stride_lon, stride_loh,
    L: tl.constexpr,
    R: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    IS_FP8: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8_FP16: tl.constexpr,  # unused: q arrives in the products' dtype
    FP8_PTX: tl.constexpr,
    BALANCED: tl.constexpr,
    LOW_SPLITS: tl.constexpr = 0,
    PAGES: tl.constexpr = 0,  # > 0: page ids in blocks of PAGES, gathered (config gather_pages)
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    pid_h = tl.program_id(0)
    if BALANCED:
        pid_s = tl.program_id(1)
        item = plan_ptr + pid_s * 4  # _decode_plan_kernel's (request, splits, start, end)
        pid_n = tl.load(item)
        if pid_n >= N:
            return
        count = tl.load(item + 1)
        start = tl.load(item + 2)
        end = tl.load(item + 3)
        full_end = _full_tiles_end(start, end, BLOCK_N)
    else:
        pid_s = tl.program_id(1)
        pid_n = tl.program_id(2)
        count = 0
        start, end, full_end = _split_bounds(seq_lens_ptr + pid_n * stride_sl, pid_s,
                                             num_splits, BLOCK_N)
    CH: tl.constexpr = BLOCK_L // CHUNKS
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    q_rows = q_ptr + pid_n * stride_qn + offs_h[:, None] * stride_qh  # (BLOCK_H, 1)
    acc0 = tl.zeros((BLOCK_H, CH), tl.float32)
    acc1 = tl.zeros((BLOCK_H, CH), tl.float32)
    acc2 = tl.zeros((BLOCK_H, CH), tl.float32)
    acc3 = tl.zeros((BLOCK_H, CH), tl.float32)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    bt_row_ptr = bt_ptr + pid_n * stride_btn
    if PAGES > 0:  # blocks of PAGES pages, their ids loaded once; the tiles' copies pipeline
        for b0 in range((start // PAGE_SIZE) * PAGE_SIZE, full_end, PAGES * PAGE_SIZE):
            first_page, pages, lo, hi = _page_block(bt_row_ptr, b0, start, full_end, end,
                                                    stride_btp, PAGE_SIZE, PAGES)
            for t0 in range(lo, hi, BLOCK_N):
                m_i, l_i, acc0, acc1, acc2, acc3 = _attend_tile_chunked(
                    q_rows, mask_h, m_i, l_i, acc0, acc1, acc2, acc3, kv_ptr, scale_ptr,
                    bt_row_ptr, pages, first_page, t0, end, qk_scale, stride_qd, stride_btp,
                    stride_kvp, stride_kvs, stride_kvd, stride_sp, stride_ss, L, R, PAGE_SIZE,
                    BLOCK_H, BLOCK_N, BLOCK_L, BLOCK_R, False, IS_FP8, DOT_PRECISION, FP8_PTX,
                    PAGES,
                )
    else:
        for t0 in range(start, full_end, BLOCK_N):
            m_i, l_i, acc0, acc1, acc2, acc3 = _attend_tile_chunked(
                q_rows, mask_h, m_i, l_i, acc0, acc1, acc2, acc3, kv_ptr, scale_ptr,
                bt_row_ptr, bt_row_ptr, 0, t0, end, qk_scale, stride_qd, stride_btp,
                stride_kvp, stride_kvs, stride_kvd, stride_sp, stride_ss, L, R, PAGE_SIZE,
                BLOCK_H, BLOCK_N, BLOCK_L, BLOCK_R, False, IS_FP8, DOT_PRECISION, FP8_PTX, 0,
            )
    if full_end < end:
        m_i, l_i, acc0, acc1, acc2, acc3 = _attend_tile_chunked(
            q_rows, mask_h, m_i, l_i, acc0, acc1, acc2, acc3, kv_ptr, scale_ptr, bt_row_ptr,
            bt_row_ptr, 0, full_end, end, qk_scale, stride_qd, stride_btp, stride_kvp,
            stride_kvs, stride_kvd, stride_sp, stride_ss, L, R, PAGE_SIZE, BLOCK_H, BLOCK_N,
            BLOCK_L, BLOCK_R, True, IS_FP8, DOT_PRECISION, FP8_PTX, 0,
        )
    l_safe, lse = _softmax_totals(m_i, l_i)
    offs_c = tl.arange(0, CH)
    _store_out(acc0 / l_safe[:, None], lse, offs_h, mask_h, offs_c, L, True,
               pid_n, pid_s, count, o_ptr, o_low_ptr, lse_ptr, out_ptr, lse_out_ptr,
               stride_os, stride_on, stride_oh, stride_ol, stride_ls, stride_ln, stride_lh,
               stride_outn, stride_outh, stride_outl, stride_lon, stride_loh, BALANCED,
               LOW_SPLITS)
    _store_out(acc1 / l_safe[:, None], lse, offs_h, mask_h, offs_c + CH, L, False,
               pid_n, pid_s, count, o_ptr, o_low_ptr, lse_ptr, out_ptr, lse_out_ptr,
               stride_os, stride_on, stride_oh, stride_ol, stride_ls, stride_ln, stride_lh,
               stride_outn, stride_outh, stride_outl, stride_lon, stride_loh, BALANCED,
               LOW_SPLITS)
    _store_out(acc2 / l_safe[:, None], lse, offs_h, mask_h, offs_c + 2 * CH, L, False,
               pid_n, pid_s, count, o_ptr, o_low_ptr, lse_ptr, out_ptr, lse_out_ptr,
               stride_os, stride_on, stride_oh, stride_ol, stride_ls, stride_ln, stride_lh,
               stride_outn, stride_outh, stride_outl, stride_lon, stride_loh, BALANCED,
               LOW_SPLITS)
    _store_out(acc3 / l_safe[:, None], lse, offs_h, mask_h, offs_c + 3 * CH, L, False,
               pid_n, pid_s, count, o_ptr, o_low_ptr, lse_ptr, out_ptr, lse_out_ptr,
               stride_os, stride_on, stride_oh, stride_ol, stride_ls, stride_ln, stride_lh,
               stride_outn, stride_outh, stride_outl, stride_lon, stride_loh, BALANCED,
               LOW_SPLITS)
