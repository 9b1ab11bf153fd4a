"""The tokens-on-M form of ``mla_decode``'s kernel (``config["transposed"]``, few heads per
program): scoresᵀ = kv·qᵀ puts a 64-token tile on the MMA's M side even for 16 heads. Same grid,
arguments and outputs as ``_mla_decode_kernel``; see ``mla_decode.py``'s docstring."""

from __future__ import annotations

import triton
import triton.language as tl

from splash.kernels_triton.mla_decode_kernels import (
    _load_tile,
    _q_operand,
    _softmax_totals,
    _split_bounds,
    _widen_kv,
)
from splash.kernels_triton.pdl import pdl_enter


@triton.jit
def _attend_tile_tokens_m(
    q_nope_t, q_rope_t, m_i, l_i, acc_t,
    kv_ptr, scale_ptr, bt_row_ptr,
    t0, end, qk_scale,
    stride_btp, stride_kvp, stride_kvs, stride_kvd, stride_sp, stride_ss,
    L: tl.constexpr,
    R: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    MASK_T: tl.constexpr,
    IS_FP8: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PV_HEADS_M: tl.constexpr,
    KV_IN_REGS: tl.constexpr,
    FP8_PTX: tl.constexpr,
):
    """One KV tile [t0, t0 + BLOCK_N) with the tokens on the MMA's M side:
    scoresᵀ (BLOCK_N, BLOCK_H) = kv_nope · q_nopeᵀ + kv_rope · q_ropeᵀ and
    accᵀ (BLOCK_L, BLOCK_H) += kv_nopeᵀ · pᵀ, so a 64-token tile fills a Hopper MMA even for 16
    heads. The softmax runs down the columns (one per head). PV_HEADS_M computes the value
    product the other way round, acc (BLOCK_H, BLOCK_L) += p · kv_nope (kv_nope as the B
    operand). KV_IN_REGS passes a bf16/fp16 tile through an opaque register move first, so both
    products take it from registers as the fp8 path does (Triton 3.6 computed the bf16
    kv_nopeᵀ-from-shared-memory product wrongly on H200).

    Tail tile (MASK_T): rows at or past ``end`` re-read the last valid row (``end - 1``), so every
    load is unmasked and in bounds (no padded block-table entry is ever dereferenced), and their
    scores are set to -inf before the max: their p is exactly 0. The tile holds at least one valid
    row (the caller only passes tiles with t0 < end), so the running max stays finite (no NaN).
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_t = t0 + offs_n
    if MASK_T:
        mask_t = offs_t < end
        offs_t = tl.minimum(offs_t, end - 1)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    if PAGE_SIZE % BLOCK_N == 0:
        # the tile lies in one page (t0 is BLOCK_N-aligned and t0 < end)
        page = tl.load(bt_row_ptr + (t0 // PAGE_SIZE) * stride_btp).to(tl.int64)
    else:
        page = tl.load(bt_row_ptr + (offs_t // PAGE_SIZE) * stride_btp).to(tl.int64)
    page = tl.maximum(page, 0)  # belt and braces: never a negative page offset
    row_off = page * stride_kvp + (offs_t % PAGE_SIZE) * stride_kvs  # (BLOCK_N,)
    kv_nope = _load_tile(
        kv_ptr + row_off[:, None] + offs_l[None, :] * stride_kvd,
        offs_n, offs_l < L, False, BLOCK_L != L,
    )  # (BLOCK_N, BLOCK_L)
    kv_rope = _load_tile(
        kv_ptr + row_off[:, None] + (L + offs_r)[None, :] * stride_kvd,
        offs_n, offs_r < R, False, BLOCK_R != R,
    )  # (BLOCK_N, BLOCK_R)
    if IS_FP8:
        row_scale = tl.load(scale_ptr + page * stride_sp + (offs_t % PAGE_SIZE) * stride_ss)
        kv_nope = _widen_kv(kv_nope, q_nope_t.dtype, FP8_PTX)  # exact; fp16 under FP8_FP16
        kv_rope = kv_rope.to(q_nope_t.dtype)
    elif KV_IN_REGS:
        kv_nope = tl.inline_asm_elementwise(
            "mov.b32 $0, $1;", "=r,r", [kv_nope], dtype=kv_nope.dtype, is_pure=True, pack=2
        )
    qk = tl.dot(kv_nope, q_nope_t, input_precision=DOT_PRECISION)
    qk = tl.dot(kv_rope, q_rope_t, qk, input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_H)
    if IS_FP8:
        qk = qk * (row_scale * qk_scale)[:, None]
    else:
        qk = qk * qk_scale
    if MASK_T:
        qk = tl.where(mask_t[:, None], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 0))  # (BLOCK_H,), finite: one valid row per tile
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[None, :])  # (BLOCK_N, BLOCK_H); 0 on masked rows
    l_i = l_i * alpha + tl.sum(p, 0)
    if IS_FP8:
        p = p * row_scale[:, None]
    if PV_HEADS_M:  # acc_t is (BLOCK_H, BLOCK_L) here
        acc_t = acc_t * alpha[:, None]
        acc_t = tl.dot(tl.trans(p.to(kv_nope.dtype)), kv_nope, acc_t,
                       input_precision=DOT_PRECISION)
    else:
        acc_t = acc_t * alpha[None, :]
        acc_t = tl.dot(tl.trans(kv_nope), p.to(kv_nope.dtype), acc_t,
                       input_precision=DOT_PRECISION)
    return m_new, l_i, acc_t


@triton.jit(do_not_specialize=["num_splits", "stride_btn"])  # ints that vary by step: one binary for all
def _mla_decode_tokens_m_kernel(
    q_ptr, kv_ptr, scale_ptr, bt_ptr, seq_lens_ptr, o_ptr, lse_ptr,
    qk_scale,
    H,
    num_splits,
    stride_qn, stride_qh, stride_qd,
    stride_kvp, stride_kvs, stride_kvd,
    stride_sp, stride_ss,
    stride_btn, stride_btp,
    stride_sl,
    stride_os, stride_on, stride_oh, stride_ol,
    stride_ls, stride_ln, stride_lh,
    L: tl.constexpr,
    R: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    IS_FP8: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PV_HEADS_M: tl.constexpr,
    KV_IN_REGS: tl.constexpr,
    FP8_FP16: tl.constexpr,
    FP8_PTX: tl.constexpr,  # _widen_kv
    PDL: tl.constexpr = False,
):
    """``_mla_decode_kernel`` with the tokens on the MMA's M side (``config["transposed"]``):
    same grid, arguments and outputs."""
    pdl_enter(PDL)
    pid_h = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_n = tl.program_id(2)

    start, end, full_end = _split_bounds(seq_lens_ptr + pid_n * stride_sl, pid_s, num_splits,
                                         BLOCK_N)

    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_l = tl.arange(0, BLOCK_L)
    mask_l = offs_l < L
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    q_base = q_ptr + pid_n * stride_qn
    q_nope_t = tl.load(
        q_base + offs_l[:, None] * stride_qd + offs_h[None, :] * stride_qh,
        mask=mask_l[:, None] & mask_h[None, :], other=0.0,
    )  # (BLOCK_L, BLOCK_H)
    q_rope_t = tl.load(
        q_base + (L + offs_r)[:, None] * stride_qd + offs_h[None, :] * stride_qh,
        mask=mask_r[:, None] & mask_h[None, :], other=0.0,
    )  # (BLOCK_R, BLOCK_H)
    q_nope_t = _q_operand(q_nope_t, IS_FP8, FP8_FP16)
    q_rope_t = _q_operand(q_rope_t, IS_FP8, FP8_FP16)
    if PV_HEADS_M:
        acc_t = tl.zeros((BLOCK_H, BLOCK_L), tl.float32)
    else:
        acc_t = tl.zeros((BLOCK_L, BLOCK_H), tl.float32)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)

    bt_row_ptr = bt_ptr + pid_n * stride_btn
    for t0 in range(start, full_end, BLOCK_N):
        m_i, l_i, acc_t = _attend_tile_tokens_m(
            q_nope_t, q_rope_t, m_i, l_i, acc_t, kv_ptr, scale_ptr, bt_row_ptr, t0, end, qk_scale,
            stride_btp, stride_kvp, stride_kvs, stride_kvd, stride_sp, stride_ss,
            L, R, PAGE_SIZE, BLOCK_N, BLOCK_L, BLOCK_R, False, IS_FP8, DOT_PRECISION,
            PV_HEADS_M, KV_IN_REGS, FP8_PTX,
        )
    if full_end < end:
        m_i, l_i, acc_t = _attend_tile_tokens_m(
            q_nope_t, q_rope_t, m_i, l_i, acc_t, kv_ptr, scale_ptr, bt_row_ptr, full_end, end,
            qk_scale, stride_btp, stride_kvp, stride_kvs, stride_kvd, stride_sp, stride_ss,
            L, R, PAGE_SIZE, BLOCK_N, BLOCK_L, BLOCK_R, True, IS_FP8, DOT_PRECISION,
            PV_HEADS_M, KV_IN_REGS, FP8_PTX,
        )

    l_safe, lse = _softmax_totals(m_i, l_i)
    if PV_HEADS_M:
        out = acc_t / l_safe[:, None]  # (BLOCK_H, BLOCK_L)
    else:
        out = tl.trans(acc_t / l_safe[None, :])
    o_base = o_ptr + pid_s * stride_os + pid_n * stride_on
    o_ptrs = o_base + offs_h[:, None] * stride_oh + offs_l[None, :] * stride_ol
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_l[None, :])
    tl.store(lse_ptr + pid_s * stride_ls + pid_n * stride_ln + offs_h * stride_lh, lse, mask=mask_h)
