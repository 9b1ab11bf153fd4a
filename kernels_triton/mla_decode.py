"""Absorbed MLA decode over a paged latent KV cache (split-KV, many heads per program).

One query row per request: ``q`` (N, H, D) holds, per head, ``q_nope @ W_UK`` (L dims) followed
by the roped ``q_rope`` (R dims). Every head attends the same latent rows of its request, taken
page by page through ``block_table``: score = q · row (all D dims), value = row[:L]. So

    out[n, h] = softmax_t(sm_scale * q[n, h] · kv[t]) @ kv[t, :L],   lse = log sum_t exp(...)

Design:
- A program owns a *head group* of ``BLOCK_H`` heads (up to 64) of one request and one KV split,
  so each KV tile is loaded once per head group and both products are tensor-core ``tl.dot``s:
  scores (BLOCK_H, BLOCK_N) = q_nope·kv_nopeᵀ + q_rope·kv_ropeᵀ, acc (BLOCK_H, L) += p·kv_nope.
  The peer kernel re-reads every tile for each 16 heads; with 128 heads that is 8 reads.
- Split-KV: ``num_splits`` programs share a request's tokens (tile-aligned ranges); each writes a
  normalised fp32 partial and its lse, and ``lse_merge``'s kernel combines them. With one split the
  program writes the final output directly. Head groups of a (request, split) sit next to each
  other in the grid, so they run together and share tiles through L2.
- L and R need not be powers of two: tiles are padded to ``BLOCK_L``/``BLOCK_R`` and masked.
- fp8 KV: a row is fp8 × one fp32 scale. The tile is widened to the query dtype (exact), the
  scale multiplies the scores' column and p's column, so no per-element scaling is needed.
- Few heads (``config["transposed"]``, the GPU default for H <= 32): a second kernel puts the
  tokens on the MMA's M side (scoresᵀ = kv·qᵀ, accᵀ += kv_nopeᵀ·pᵀ), so a 64-token tile fills a
  Hopper MMA with only 16 heads. Its tail tile clamps rows past the length to the last valid row
  (every load unmasked and in bounds) and sets their scores to -inf before the max.
- Full tiles load without a token mask; only a split's last partial tile is masked. When the
  page size is a multiple of ``BLOCK_N`` a tile lies in one page and its page id is one load.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from splash.kernels_triton import _validate as V
from splash.kernels_triton.lse_merge import _merge_into

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 64


@triton.jit
def _load_tile(ptrs, mask_rows, mask_cols, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr):
    """Load a 2-D tile, masking rows and/or columns only where the constexprs ask for it."""
    if MASK_ROWS:
        if MASK_COLS:
            x = tl.load(ptrs, mask=mask_rows[:, None] & mask_cols[None, :], other=0.0)
        else:
            x = tl.load(ptrs, mask=mask_rows[:, None], other=0.0)
    else:
        if MASK_COLS:
            x = tl.load(ptrs, mask=mask_cols[None, :], other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _load_kv_tile(
    kv_ptr, scale_ptr, bt_row_ptr, t0, end,
    stride_btp, stride_kvp, stride_kvs, stride_kvd, stride_sp, stride_ss,
    L: tl.constexpr,
    R: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    MASK_T: tl.constexpr,
    IS_FP8: tl.constexpr,
):
    """Rows [t0, t0 + BLOCK_N) of one request: nope (BLOCK_N, BLOCK_L), rope (BLOCK_N, BLOCK_R),
    the token mask and the per-row fp8 scale (1.0 when not fp8)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_t = t0 + offs_n  # (BLOCK_N,) token positions
    mask_t = offs_t < end
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    if PAGE_SIZE % BLOCK_N == 0:
        # tiles are BLOCK_N-aligned, so the whole tile sits in one page
        page = tl.load(bt_row_ptr + (t0 // PAGE_SIZE) * stride_btp).to(tl.int64)
        in_page = (t0 % PAGE_SIZE) + offs_n
    else:
        page = tl.load(bt_row_ptr + (offs_t // PAGE_SIZE) * stride_btp, mask=mask_t, other=0)
        page = page.to(tl.int64)
        in_page = offs_t % PAGE_SIZE
    row_off = page * stride_kvp + in_page * stride_kvs  # (BLOCK_N,)
    kv_nope = _load_tile(
        kv_ptr + row_off[:, None] + offs_l[None, :] * stride_kvd,
        mask_t, offs_l < L, MASK_T, BLOCK_L != L,
    )  # (BLOCK_N, BLOCK_L)
    kv_rope = _load_tile(
        kv_ptr + row_off[:, None] + (L + offs_r)[None, :] * stride_kvd,
        mask_t, offs_r < R, MASK_T, BLOCK_R != R,
    )  # (BLOCK_N, BLOCK_R)
    if IS_FP8:
        scale_ptrs = scale_ptr + page * stride_sp + in_page * stride_ss
        if MASK_T:
            row_scale = tl.load(scale_ptrs, mask=mask_t, other=0.0)
        else:
            row_scale = tl.load(scale_ptrs)
    else:
        row_scale = tl.full((BLOCK_N,), 1.0, tl.float32)
    return kv_nope, kv_rope, mask_t, row_scale


@triton.jit
def _attend_tile(
    q_nope, q_rope, m_i, l_i, acc, q_pos,
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
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One KV tile [t0, t0 + BLOCK_N) (tokens < ``end``) folded into the online softmax of the
    query rows (heads for decode, chunk rows for extend): q_nope (BLOCK_H, BLOCK_L), scores
    (BLOCK_H, BLOCK_N), acc (BLOCK_H, BLOCK_L). CAUSAL (extend) also hides tokens after each
    row's position ``q_pos`` (BLOCK_H,).

    fp8 KV: the tile is widened to the query dtype (exact); the row scales multiply the scores'
    columns and p's columns.
    """
    kv_nope, kv_rope, mask_t, row_scale = _load_kv_tile(
        kv_ptr, scale_ptr, bt_row_ptr, t0, end,
        stride_btp, stride_kvp, stride_kvs, stride_kvd, stride_sp, stride_ss,
        L, R, PAGE_SIZE, BLOCK_N, BLOCK_L, BLOCK_R, MASK_T, IS_FP8,
    )
    if IS_FP8:
        kv_nope = kv_nope.to(q_nope.dtype)  # exact: fp8 values fit the query dtype
        kv_rope = kv_rope.to(q_nope.dtype)
        col_scale = row_scale * qk_scale
    else:
        col_scale = tl.full((BLOCK_N,), 1.0, tl.float32) * qk_scale
    qk = tl.dot(q_nope, tl.trans(kv_nope), input_precision=DOT_PRECISION)
    qk = tl.dot(q_rope, tl.trans(kv_rope), qk, input_precision=DOT_PRECISION)  # (BLOCK_H, BLOCK_N)
    qk = qk * col_scale[None, :]
    if CAUSAL:
        offs_t = t0 + tl.arange(0, BLOCK_N)
        visible = (offs_t[None, :] <= q_pos[:, None]) & mask_t[None, :]
        qk = tl.where(visible, qk, float("-inf"))
    elif MASK_T:
        qk = tl.where(mask_t[None, :], qk, float("-inf"))
    # every row has seen a visible token by its first tile, so m_new is finite
    m_new = tl.maximum(m_i, tl.max(qk, 1))  # (BLOCK_H,)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])  # (BLOCK_H, BLOCK_N)
    l_i = l_i * alpha + tl.sum(p, 1)
    if IS_FP8:
        p = p * row_scale[None, :]
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(kv_nope.dtype), kv_nope, acc, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _mla_decode_kernel(
    q_ptr,  # (N, H, D)
    kv_ptr,  # (P, PS, D)
    scale_ptr,  # (P, PS) fp32, fp8 caches only
    bt_ptr,  # (N, max_pages) int
    seq_lens_ptr,  # (N,) int
    o_ptr,  # (S, N, H, L) fp32 partials, or (N, H, L) output when S == 1
    lse_ptr,  # (S, N, H) fp32, or (N, H)
    qk_scale,  # sm_scale * log2(e)
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
):
    pid_h = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_n = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + pid_n * stride_sl).to(tl.int32)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N  # tile-aligned
    start = pid_s * split_len
    end = tl.minimum(start + split_len, seq_len)
    full_end = start + (tl.maximum(end - start, 0) // BLOCK_N) * BLOCK_N

    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_l = tl.arange(0, BLOCK_L)
    mask_l = offs_l < L
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    q_base = q_ptr + pid_n * stride_qn
    q_nope = tl.load(
        q_base + offs_h[:, None] * stride_qh + offs_l[None, :] * stride_qd,
        mask=mask_h[:, None] & mask_l[None, :], other=0.0,
    )  # (BLOCK_H, BLOCK_L)
    q_rope = tl.load(
        q_base + offs_h[:, None] * stride_qh + (L + offs_r)[None, :] * stride_qd,
        mask=mask_h[:, None] & mask_r[None, :], other=0.0,
    )  # (BLOCK_H, BLOCK_R)
    acc = tl.zeros((BLOCK_H, BLOCK_L), tl.float32)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)

    bt_row_ptr = bt_ptr + pid_n * stride_btn
    # full tiles unmasked, then the split's partial tail tile
    for t0 in range(start, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q_nope, q_rope, m_i, l_i, acc, m_i, kv_ptr, scale_ptr, bt_row_ptr, t0, end, qk_scale,
            stride_btp, stride_kvp, stride_kvs, stride_kvd, stride_sp, stride_ss,
            L, R, PAGE_SIZE, BLOCK_N, BLOCK_L, BLOCK_R, False, IS_FP8, False, DOT_PRECISION,
        )
    if full_end < end:
        m_i, l_i, acc = _attend_tile(
            q_nope, q_rope, m_i, l_i, acc, m_i, kv_ptr, scale_ptr, bt_row_ptr, full_end, end,
            qk_scale, stride_btp, stride_kvp, stride_kvs, stride_kvd, stride_sp, stride_ss,
            L, R, PAGE_SIZE, BLOCK_N, BLOCK_L, BLOCK_R, True, IS_FP8, False, DOT_PRECISION,
        )

    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    lse = tl.where(has_keys, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    o_base = o_ptr + pid_s * stride_os + pid_n * stride_on
    out = acc / l_safe[:, None]  # (BLOCK_H, BLOCK_L)
    o_ptrs = o_base + offs_h[:, None] * stride_oh + offs_l[None, :] * stride_ol
    o_mask = mask_h[:, None] & mask_l[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=o_mask)
    tl.store(lse_ptr + pid_s * stride_ls + pid_n * stride_ln + offs_h * stride_lh, lse, mask=mask_h)


# ---------------------------------------------------------------------------------------------
# tokens-on-M form (few heads per program)


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
        kv_nope = kv_nope.to(q_nope_t.dtype)  # exact: fp8 values fit the query dtype
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


@triton.jit
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
):
    """``_mla_decode_kernel`` with the tokens on the MMA's M side (``config["transposed"]``):
    same grid, arguments and outputs."""
    pid_h = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_n = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + pid_n * stride_sl).to(tl.int32)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N  # tile-aligned
    start = pid_s * split_len
    end = tl.minimum(start + split_len, seq_len)
    full_end = start + (tl.maximum(end - start, 0) // BLOCK_N) * BLOCK_N

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
            PV_HEADS_M, KV_IN_REGS,
        )
    if full_end < end:
        m_i, l_i, acc_t = _attend_tile_tokens_m(
            q_nope_t, q_rope_t, m_i, l_i, acc_t, kv_ptr, scale_ptr, bt_row_ptr, full_end, end,
            qk_scale, stride_btp, stride_kvp, stride_kvs, stride_kvd, stride_sp, stride_ss,
            L, R, PAGE_SIZE, BLOCK_N, BLOCK_L, BLOCK_R, True, IS_FP8, DOT_PRECISION,
            PV_HEADS_M, KV_IN_REGS,
        )

    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    lse = tl.where(has_keys, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    if PV_HEADS_M:
        out = acc_t / l_safe[:, None]  # (BLOCK_H, BLOCK_L)
    else:
        out = tl.trans(acc_t / l_safe[None, :])
    o_base = o_ptr + pid_s * stride_os + pid_n * stride_on
    o_ptrs = o_base + offs_h[:, None] * stride_oh + offs_l[None, :] * stride_ol
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_l[None, :])
    tl.store(lse_ptr + pid_s * stride_ls + pid_n * stride_ln + offs_h * stride_lh, lse, mask=mask_h)


# ---------------------------------------------------------------------------------------------
# launcher

_GPU_DEFAULTS: dict[str, Any] = {
    # mirrors backends/cuda.py's TUNING["mla_decode"] (measured on H200,
    # benchmarks/results/h200/kernels.json). Few heads, bf16: the tokens-on-M kernel with the
    # value product heads-on-M ("pv_heads_m"), 32-token tiles, 3 stages, 2 programs per SM in
    # the wave model.
    "transposed": True, "pv_heads_m": True, "BLOCK_N": 32, "BLOCK_H": 16, "num_warps": 4,
    "num_stages": 3, "max_block_h": 64, "programs_per_sm": 2, "split_overhead_tokens": 512,
    "min_split_tokens": 256,
    # applied when H > 32: 64 heads x 512 fp32 accumulators need 8 warps
    "many_heads": {"transposed": False, "BLOCK_H": 64, "BLOCK_N": 32, "num_warps": 8,
                   "num_stages": 2, "programs_per_sm": 1, "split_overhead_tokens": 64},
    # fp8 KV, few heads: the heads-on-M kernel is faster (0.26 vs 0.34 ms at 64x4K)
    "fp8": {"transposed": False, "BLOCK_N": 16, "num_warps": 4, "num_stages": 3,
            "programs_per_sm": 4, "split_overhead_tokens": 64,
            "many_heads": {"BLOCK_N": 32, "num_warps": 8, "num_stages": 2, "programs_per_sm": 1}},
}
_CPU_DEFAULTS: dict[str, Any] = {
    "BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "max_block_h": 16,
    "programs_per_sm": 1, "split_overhead_tokens": 16, "min_split_tokens": 32,
}


def decode_config(
    num_heads: int, device: torch.device, config: dict | None, fp8: bool = False
) -> dict[str, Any]:
    """Launch parameters: device defaults, then ``config``. In each, a ``many_heads`` sub-dict
    applies when H > 32 and an ``fp8`` sub-dict (which may hold its own ``many_heads``) when the
    KV cache is fp8. Fills BLOCK_H (power of two >= 16, at most ``max_block_h``).
    ``transposed`` picks the tokens-on-M kernel (heads on the MMA's N side)."""
    cfg: dict[str, Any] = {}

    def apply(layer: dict[str, Any], nested: bool) -> None:
        cfg.update({k: v for k, v in layer.items() if k not in ("many_heads", "fp8")})
        if num_heads > 32:
            cfg.update(layer.get("many_heads", {}))
        if nested and fp8 and "fp8" in layer:
            apply(layer["fp8"], nested=False)

    if device.type == "cuda":
        base = dict(_GPU_DEFAULTS)
        if torch.version.hip is not None:
            base["transposed"] = False  # the tokens-on-M kernel is verified on CUDA only
    else:
        base = _CPU_DEFAULTS
    apply(base, nested=True)
    apply(config or {}, nested=True)
    if "BLOCK_H" not in cfg:
        cfg["BLOCK_H"] = min(int(cfg["max_block_h"]), V.next_pow2(num_heads, 16))
    for key in ("BLOCK_H", "BLOCK_N"):
        value = cfg[key]
        if not isinstance(value, int) or value < 16 or value & (value - 1):
            raise ValueError(f"config {key}={value!r} must be a power of two >= 16")
    return cfg


def choose_num_splits(
    batch: int, head_groups: int, max_len: int, device: torch.device, cfg: dict[str, Any]
) -> int:
    """The split count that minimises estimated time = waves × (tokens per split + a fixed
    per-program cost), with ``programs_per_sm`` resident programs per SM and at least
    ``min_split_tokens`` tokens per split. ``max_len`` is the block-table capacity (no sync)."""
    programs = max(batch * head_groups, 1)
    slots = max(1, int(cfg["programs_per_sm"]) * V.num_sms(device))
    overhead = float(cfg["split_overhead_tokens"])
    limit = max(1, min(_MAX_SPLITS, math.ceil(max(max_len, 1) / int(cfg["min_split_tokens"]))))
    best, best_cost = 1, float("inf")
    for splits in range(1, limit + 1):
        waves = math.ceil(programs * splits / slots)
        cost = waves * (max_len / splits + overhead)
        if cost < best_cost * 0.999:  # ties go to fewer splits (less merge work)
            best, best_cost = splits, cost
    return best


def _check_decode_args(q, kv_cache, block_table, seq_lens, kv_lora_rank, kv_scale):
    V.check_tensor("q", q, 3, V.FLOAT_DTYPES)
    dev = q.device
    kv = V.check_kv_cache(kv_cache, dev)
    V.check_kv_scale(kv, kv_scale)
    if not V.is_fp8(kv.dtype) and kv.dtype != q.dtype:
        raise ValueError(f"q is {q.dtype} but kv_cache is {kv.dtype}; they must match (or fp8 KV)")
    D = kv.shape[2]
    V.check_dim("q", q, 2, D, "the KV row width L + R of kv_cache")
    if not isinstance(kv_lora_rank, int) or not 0 < kv_lora_rank < D:
        raise ValueError(f"kv_lora_rank={kv_lora_rank!r} must be an int in (0, D={D})")
    V.check_tensor("block_table", block_table, 2, V.INDEX_DTYPES, dev)
    V.check_tensor("seq_lens", seq_lens, 1, V.INDEX_DTYPES, dev)
    return kv


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    kv_lora_rank: int,
    kv_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode: ``q`` (N, H, L+R), ``kv_cache`` (P, PS, L+R), ``block_table``
    (N, max_pages), ``seq_lens`` (N,) -> ``(out (N, H, L) in q.dtype, lse (N, H) fp32)``.
    A length of 0 gives out 0 and lse -inf. ``num_splits=None`` picks it from N, the block-table
    capacity and the device's SM count."""
    kv = _check_decode_args(q, kv_cache, block_table, seq_lens, kv_lora_rank, kv_scale)
    N, H, D = q.shape
    L, R = kv_lora_rank, D - kv_lora_rank
    P, PS = kv.shape[0], kv.shape[1]
    V.check_dim("block_table", block_table, 0, N, "one row per query row of q")
    V.check_dim("seq_lens", seq_lens, 0, N, "one length per query row of q")
    V.check_paged_lengths(block_table, seq_lens, PS, P)
    out = torch.empty((N, H, L), dtype=q.dtype, device=q.device)
    lse = torch.empty((N, H), dtype=torch.float32, device=q.device)
    if N == 0 or H == 0:
        return out, lse

    cfg = decode_config(H, q.device, config, fp8=V.is_fp8(kv.dtype))
    BLOCK_H, BLOCK_N = cfg["BLOCK_H"], cfg["BLOCK_N"]
    head_groups = triton.cdiv(H, BLOCK_H)
    if num_splits is None:
        num_splits = cfg.get("num_splits") or choose_num_splits(
            N, head_groups, block_table.shape[1] * PS, q.device, cfg
        )
    if not isinstance(num_splits, int) or not 1 <= num_splits <= 65535:
        raise ValueError(f"num_splits={num_splits!r} must be an int in [1, 65535]")
    if N > 65535:
        raise ValueError(f"mla_decode takes at most 65535 rows per launch, got N={N}")

    if num_splits == 1:
        o_part, lse_part = out, lse  # the program writes the final output itself
        stride_os, stride_ls = 0, 0
    else:
        o_part = torch.empty((num_splits, N, H, L), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((num_splits, N, H), dtype=torch.float32, device=q.device)
        stride_os, stride_ls = o_part.stride(0), lse_part.stride(0)
    scale = kv_scale if kv_scale is not None else lse  # never read unless fp8
    grid = (head_groups, num_splits, N)
    extra = {}
    kernel = _mla_decode_kernel
    if cfg.get("transposed"):
        kernel = _mla_decode_tokens_m_kernel
        extra = {"PV_HEADS_M": bool(cfg.get("pv_heads_m", False)),
                 "KV_IN_REGS": bool(cfg.get("kv_in_regs", False)) and q.is_cuda
                 and kv.dtype in (torch.bfloat16, torch.float16)}
    kernel[grid](
        q, kv, scale, block_table, seq_lens, o_part, lse_part,
        float(sm_scale) * _LOG2E, H, num_splits,
        *q.stride(), *kv.stride(),
        *(scale.stride() if kv_scale is not None else (0, 0)),
        *block_table.stride(), seq_lens.stride(0),
        stride_os, *o_part.stride()[-3:],
        stride_ls, *lse_part.stride()[-2:],
        L=L, R=R, PAGE_SIZE=PS, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N,
        BLOCK_L=V.next_pow2(L), BLOCK_R=V.next_pow2(R),
        IS_FP8=V.is_fp8(kv.dtype),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **extra,
    )
    if num_splits > 1:
        _merge_into(o_part, lse_part, out, lse)
    return out, lse


# ---------------------------------------------------------------------------------------------
# reference


def paged_rows_ref(
    kv_cache: torch.Tensor, kv_scale: torch.Tensor | None, pages: torch.Tensor, length: int
) -> torch.Tensor:
    """The first ``length`` latent rows of one request, dequantised, in fp64: (length, D)."""
    PS = kv_cache.shape[1]
    num_pages = -(-length // PS)
    idx = pages[:num_pages].long()
    rows = kv_cache[idx].double()  # (num_pages, PS, D)
    if kv_scale is not None:
        rows = rows * kv_scale[idx].double()[..., None]
    return rows.reshape(-1, kv_cache.shape[2])[:length]


def mla_decode_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    kv_lora_rank: int,
    kv_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of ``mla_decode`` (fp64 math, one request at a time)."""
    N, H, _ = q.shape
    L = kv_lora_rank
    out = torch.zeros((N, H, L), dtype=torch.float64, device=q.device)
    lse = torch.full((N, H), float("-inf"), dtype=torch.float64, device=q.device)
    for n in range(N):
        length = int(seq_lens[n])
        if length == 0:
            continue
        rows = paged_rows_ref(kv_cache, kv_scale, block_table[n], length)  # (len, D)
        scores = (q[n].double() @ rows.T) * sm_scale  # (H, len)
        lse[n] = torch.logsumexp(scores, dim=-1)
        out[n] = torch.softmax(scores, dim=-1) @ rows[:, :L]  # (H, L)
    return out.to(q.dtype), lse.float()
