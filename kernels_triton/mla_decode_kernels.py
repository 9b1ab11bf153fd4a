"""Triton kernels of ``mla_decode`` (the launcher, configuration and references live in
``mla_decode.py``): the head-group kernel and the tile helpers it shares with
``mla_decode_chunked``, ``mla_sparse`` and ``mla_extend``. See ``mla_decode.py``'s docstring for
the design.

fp8 KV with ``FP8_FP16`` (``config["fp8_fp16"]``, the CUDA default): both products run on fp16
operands whatever q's dtype. ``_q_operand`` clamps the query tile to fp16's finite range
[-65504, 65504] and casts it to fp16 once per program; the fp8 KV tiles widen to fp16 (exact: every
e4m3 value is an fp16 value) and p is rounded to fp16 for the value product. Accumulators and the
softmax statistics stay fp32 and the output keeps q's dtype. On Hopper fp8 -> fp16 is one native
conversion per two values while fp8 -> bf16 is emulated, which made bf16 products with fp8 KV
slower than a bf16 cache. Numerics: q entries beyond ±65504 saturate instead of becoming inf / NaN
(no finite bf16 query of a real model comes near that); bf16 q values inside the range convert
exactly unless below fp16's normal range (|x| < 2^-14, then rounded to fp16's subnormal steps of
2^-24); p·scale keeps 11 significant bits down to 2^-14 (better than bf16's 8) and an absolute
step of 2^-24 below. The references dequantise the same fp8 values and scales.
"""

from __future__ import annotations

import triton
import triton.language as tl

from splash.kernels_triton.paged_ids import _gather_page_ids, _page_block
from splash.kernels_triton.pdl import pdl_enter

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
def _q_operand(q, IS_FP8: tl.constexpr, FP8_FP16: tl.constexpr):
    """The query tile as the products' operand: with fp8 KV and FP8_FP16, clamped to fp16's
    finite range (a huge entry saturates instead of turning into inf) and cast to fp16; else
    unchanged. Called once per program, after the load."""
    if IS_FP8:
        if FP8_FP16:
            q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    return q


@triton.jit
def _widen_kv(kv, dtype, FP8_PTX: tl.constexpr):
    """An fp8 KV tile widened exactly to ``dtype``. FP8_PTX (e4m3 to fp16, NVIDIA sm_89+): by
    PTX's native conversion, four values a register, in an op the compiler may not copy (not
    pure), so one widened tile in shared memory feeds both products; a plain cast is hoisted into
    each product's operand layout instead, where the fp8 tile is read from shared memory byte by
    byte and widened twice (1.8x the instructions of the loop, offline sm_90 compile)."""
    if FP8_PTX:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
            "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [kv.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4)
    return kv.to(dtype)


@triton.jit
def _split_bounds(seq_len_ptr, pid_s, num_splits, BLOCK_N: tl.constexpr):
    """[start, end) of split ``pid_s`` of a request (tile-aligned ranges) and ``full_end``, the
    end of its full tiles (the rest is one masked tail tile)."""
    seq_len = tl.load(seq_len_ptr).to(tl.int32)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = pid_s * split_len
    end = tl.minimum(start + split_len, seq_len)
    return start, end, _full_tiles_end(start, end, BLOCK_N)


@triton.jit
def _full_tiles_end(start, end, BLOCK_N: tl.constexpr):
    """The end of the full tiles of [start, end) (the rest is one masked tail tile)."""
    return start + (tl.maximum(end - start, 0) // BLOCK_N) * BLOCK_N


@triton.jit
def _softmax_totals(m_i, l_i):
    """The divisor (1 where no key was seen) and the natural-log lse (-inf there)."""
    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    lse = tl.where(has_keys, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    return l_safe, lse


@triton.jit
def _kv_rows(
    scale_ptr, bt_row_ptr, t0, end, stride_btp, stride_kvp, stride_kvs, stride_sp, stride_ss,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK_T: tl.constexpr,
    IS_FP8: tl.constexpr,
    pages=None,
    first_page=0,
    PAGES: tl.constexpr = 0,
):
    """Rows [t0, t0 + BLOCK_N) of one request's paged KV: each row's offset in the pool, the
    token mask (rows before ``end``) and the per-row fp8 scale (1.0 when not fp8). With
    PAGES > 0 the page ids are gathered from ``pages`` (PAGES ids from ``first_page`` on, in
    registers) instead of loaded, so no load inside the loop gates the tile's copies."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_t = t0 + offs_n  # (BLOCK_N,) token positions
    mask_t = offs_t < end
    if PAGES > 0:
        page = _gather_page_ids(pages, first_page, offs_t, PAGE_SIZE, PAGES).to(tl.int64)
        in_page = offs_t % PAGE_SIZE
        row_off = page * stride_kvp + in_page * stride_kvs
        scale_off = page * stride_sp + in_page * stride_ss
    elif PAGE_SIZE % BLOCK_N == 0:
        # tiles are BLOCK_N-aligned, so the whole tile sits in one page: one scalar base, and
        # the rows' offsets stay loop-invariant (as (t0 % PAGE_SIZE + offs_n) * stride the loop
        # recomputed every row's address wherever t0's alignment is unknown to the compiler:
        # 11% slower)
        page = tl.load(bt_row_ptr + (t0 // PAGE_SIZE) * stride_btp).to(tl.int64)
        in_page = t0 % PAGE_SIZE
        row_off = page * stride_kvp + in_page * stride_kvs + offs_n * stride_kvs
        scale_off = page * stride_sp + in_page * stride_ss + offs_n * stride_ss
    else:
        page = tl.load(bt_row_ptr + (offs_t // PAGE_SIZE) * stride_btp, mask=mask_t, other=0)
        page = page.to(tl.int64)
        in_page = offs_t % PAGE_SIZE
        row_off = page * stride_kvp + in_page * stride_kvs  # (BLOCK_N,)
        scale_off = page * stride_sp + in_page * stride_ss
    if IS_FP8:
        if MASK_T:
            row_scale = tl.load(scale_ptr + scale_off, mask=mask_t, other=0.0)
        else:
            row_scale = tl.load(scale_ptr + scale_off)
    else:
        row_scale = tl.full((BLOCK_N,), 1.0, tl.float32)
    return row_off, mask_t, row_scale


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
    pages=None,
    first_page=0,
    PAGES: tl.constexpr = 0,
):
    """Rows [t0, t0 + BLOCK_N) of one request: nope (BLOCK_N, BLOCK_L), rope (BLOCK_N, BLOCK_R),
    the token mask and the per-row fp8 scale (1.0 when not fp8); page ids as ``_kv_rows``."""
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    row_off, mask_t, row_scale = _kv_rows(scale_ptr, bt_row_ptr, t0, end, stride_btp,
                                          stride_kvp, stride_kvs, stride_sp, stride_ss,
                                          PAGE_SIZE, BLOCK_N, MASK_T, IS_FP8, pages,
                                          first_page, PAGES)
    kv_nope = _load_tile(
        kv_ptr + row_off[:, None] + offs_l[None, :] * stride_kvd,
        mask_t, offs_l < L, MASK_T, BLOCK_L != L,
    )  # (BLOCK_N, BLOCK_L)
    kv_rope = _load_tile(
        kv_ptr + row_off[:, None] + (L + offs_r)[None, :] * stride_kvd,
        mask_t, offs_r < R, MASK_T, BLOCK_R != R,
    )  # (BLOCK_N, BLOCK_R)
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
    FP8_PTX: tl.constexpr,
    pages=None,
    first_page=0,
    PAGES: tl.constexpr = 0,
):
    """One KV tile [t0, t0 + BLOCK_N) (tokens < ``end``) folded into the online softmax of the
    query rows (heads for decode, chunk rows for extend): q_nope (BLOCK_H, BLOCK_L), scores
    (BLOCK_H, BLOCK_N), acc (BLOCK_H, BLOCK_L). CAUSAL (extend) also hides tokens after each
    row's position ``q_pos`` (BLOCK_H,).

    fp8 KV: the tile is widened to q_nope's dtype (exact; fp16 when the caller cast q with
    ``_q_operand`` under FP8_FP16, so both products run on fp16 operands); the row scales multiply
    the scores' columns and p's columns, and p is rounded to that dtype for the value product.
    """
    kv_nope, kv_rope, mask_t, row_scale = _load_kv_tile(
        kv_ptr, scale_ptr, bt_row_ptr, t0, end,
        stride_btp, stride_kvp, stride_kvs, stride_kvd, stride_sp, stride_ss,
        L, R, PAGE_SIZE, BLOCK_N, BLOCK_L, BLOCK_R, MASK_T, IS_FP8, pages, first_page, PAGES,
    )
    if IS_FP8:
        kv_nope = _widen_kv(kv_nope, q_nope.dtype, FP8_PTX)  # exact: fp8 fits fp16/bf16/fp32
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
def _store_out(
    out, lse, offs_h, mask_h, cols, L: tl.constexpr, WRITE_LSE: tl.constexpr,
    pid_n, pid_s, count, o_ptr, o_low_ptr, lse_ptr, out_ptr, lse_out_ptr,
    stride_os, stride_on, stride_oh, stride_ol, stride_ls, stride_ln, stride_lh,
    stride_outn, stride_outh, stride_outl, stride_lon, stride_loh,
    BALANCED: tl.constexpr, LOW_SPLITS: tl.constexpr,
):
    """A program's normalised output columns ``cols`` (those below L; with WRITE_LSE also its
    lse): balanced, a request's only split writes the final output, else partial row
    ``pid_s`` (of the 16-bit rows ``o_low_ptr`` when the request has at most LOW_SPLITS
    splits); the wave model writes split ``pid_s`` of request ``pid_n`` (the final output when
    it is the only split)."""
    o_mask = mask_h[:, None] & (cols < L)[None, :]
    if BALANCED:
        if count == 1:
            final_ptrs = out_ptr + pid_n * stride_outn + offs_h[:, None] * stride_outh \
                + cols[None, :] * stride_outl
            tl.store(final_ptrs, out.to(out_ptr.dtype.element_ty), mask=o_mask)
            if WRITE_LSE:
                tl.store(lse_out_ptr + pid_n * stride_lon + offs_h * stride_loh, lse, mask=mask_h)
        else:
            part = pid_s * stride_os + offs_h[:, None] * stride_oh + cols[None, :] * stride_ol
            if count <= LOW_SPLITS:  # (o_low_ptr shares o_ptr's strides)
                tl.store(o_low_ptr + part, out.to(o_low_ptr.dtype.element_ty), mask=o_mask)
            else:
                tl.store(o_ptr + part, out.to(o_ptr.dtype.element_ty), mask=o_mask)
            if WRITE_LSE:
                tl.store(lse_ptr + pid_s * stride_ls + offs_h * stride_lh, lse, mask=mask_h)
    else:
        o_ptrs = o_ptr + pid_s * stride_os + pid_n * stride_on + offs_h[:, None] * stride_oh \
            + cols[None, :] * stride_ol
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=o_mask)
        if WRITE_LSE:
            tl.store(lse_ptr + pid_s * stride_ls + pid_n * stride_ln + offs_h * stride_lh, lse,
                     mask=mask_h)


@triton.jit(do_not_specialize=["num_splits", "stride_btn", "N"])  # vary by step: one binary
def _mla_decode_kernel(
    q_ptr,  # (N, H, D)
    kv_ptr,  # (pages, PS, D)
    scale_ptr,  # (pages, PS) fp32, fp8 caches only
    bt_ptr,  # (N, max_pages) int
    seq_lens_ptr,  # (N,) int
    o_ptr,  # (S, N, H, L) fp32 partials, or (N, H, L) output when S == 1; BALANCED: (P, 1, H, L)
    o_low_ptr,  # BALANCED: (P, 1, H, L) 16-bit partial rows (requests of <= LOW_SPLITS splits)
    lse_ptr,  # (S, N, H) fp32, or (N, H); BALANCED: (P, 1, H)
    out_ptr,  # BALANCED: (N, H, L) output (requests of one split write it directly)
    lse_out_ptr,  # BALANCED: (N, H) fp32
    plan_ptr,  # BALANCED: (programs, 4) int32, each program's work (``_decode_plan_kernel``)
    qk_scale,  # sm_scale * log2(e)
    H,
    num_splits,
    N,
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
    FP8_FP16: tl.constexpr,
    FP8_PTX: tl.constexpr,  # _widen_kv
    BALANCED: tl.constexpr,  # splits from the batch's total work (``_decode_plan_kernel``)
    LOW_SPLITS: tl.constexpr = 0,  # BALANCED: config low_partials (``low_partial_splits``)
    PAGES: tl.constexpr = 0,  # > 0: page ids in blocks of PAGES, gathered (config gather_pages)
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    pid_h = tl.program_id(0)
    if BALANCED:
        pid_s = tl.program_id(1)
        item = plan_ptr + pid_s * 4  # _decode_plan_kernel's (request, splits, start, end)
        pid_n = tl.load(item)
        if pid_n >= N:  # before the other loads: the loop then compiles 6% shorter
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
    q_nope = _q_operand(q_nope, IS_FP8, FP8_FP16)
    q_rope = _q_operand(q_rope, IS_FP8, FP8_FP16)
    acc = tl.zeros((BLOCK_H, BLOCK_L), tl.float32)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)

    bt_row_ptr = bt_ptr + pid_n * stride_btn
    # full tiles unmasked, then the split's partial tail tile
    if PAGES > 0:  # blocks of PAGES pages, their ids loaded once: the tiles' copies pipeline
        for b0 in range((start // PAGE_SIZE) * PAGE_SIZE, full_end, PAGES * PAGE_SIZE):
            first_page, pages, lo, hi = _page_block(bt_row_ptr, b0, start, full_end, end,
                                                    stride_btp, PAGE_SIZE, PAGES)
            for t0 in range(lo, hi, BLOCK_N):
                m_i, l_i, acc = _attend_tile(
                    q_nope, q_rope, m_i, l_i, acc, m_i, kv_ptr, scale_ptr, bt_row_ptr, t0, end,
                    qk_scale, stride_btp, stride_kvp, stride_kvs, stride_kvd, stride_sp,
                    stride_ss, L, R, PAGE_SIZE, BLOCK_N, BLOCK_L, BLOCK_R, False, IS_FP8, False,
                    DOT_PRECISION, FP8_PTX, pages, first_page, PAGES,
                )
    else:
        for t0 in range(start, full_end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q_nope, q_rope, m_i, l_i, acc, m_i, kv_ptr, scale_ptr, bt_row_ptr, t0, end,
                qk_scale, stride_btp, stride_kvp, stride_kvs, stride_kvd, stride_sp, stride_ss,
                L, R, PAGE_SIZE, BLOCK_N, BLOCK_L, BLOCK_R, False, IS_FP8, False, DOT_PRECISION,
                FP8_PTX,
            )
    if full_end < end:
        m_i, l_i, acc = _attend_tile(
            q_nope, q_rope, m_i, l_i, acc, m_i, kv_ptr, scale_ptr, bt_row_ptr, full_end, end,
            qk_scale, stride_btp, stride_kvp, stride_kvs, stride_kvd, stride_sp, stride_ss,
            L, R, PAGE_SIZE, BLOCK_N, BLOCK_L, BLOCK_R, True, IS_FP8, False, DOT_PRECISION,
            FP8_PTX,
        )

    l_safe, lse = _softmax_totals(m_i, l_i)
    _store_out(acc / l_safe[:, None], lse, offs_h, mask_h, offs_l, L, True,
               pid_n, pid_s, count, o_ptr, o_low_ptr, lse_ptr, out_ptr, lse_out_ptr,
               stride_os, stride_on, stride_oh, stride_ol, stride_ls, stride_ln, stride_lh,
               stride_outn, stride_outh, stride_outl, stride_lon, stride_loh, BALANCED,
               LOW_SPLITS)
