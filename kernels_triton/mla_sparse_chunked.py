"""The dimension-chunked form of ``mla_sparse``'s kernel (``config["dim_chunks"]``, the CUDA
default). Same grid, arguments and outputs as ``_mla_sparse_kernel``.

The latent dims split into four column chunks, as in ``mla_decode``'s chunked kernel: each is
gathered once per tile and feeds both products, a quarter of the scores' contraction and a
quarter of the value columns, with an accumulator of its own. A tile's loop then carries no
(BLOCK_N, 512) operand, and the sweep found it faster at every head count and KV dtype (H200,
16 rows x 2,048 selected slots, graph-timed, ``benchmarks/results/h200/dsa_sparse_chunks.json``):
16 heads bf16 0.0204 -> 0.0186 ms, fp8 0.0239 -> 0.0207; 128 heads bf16 0.0568 -> 0.0515, fp8
0.0766 -> 0.0666. Four independent score products summed instead of one chain gained nothing
at 16 heads and lost at 128 (0.0530).
"""

from __future__ import annotations

import triton
import triton.language as tl

from splash.kernels_triton.mla_decode_chunked import CHUNKS, _value_chunks
from splash.kernels_triton.mla_decode_kernels import _q_operand, _softmax_totals, _widen_kv
from splash.kernels_triton.paged_ids import _split_slots, _tile_slots
from splash.kernels_triton.pdl import pdl_enter


@triton.jit
def _q_chunk(q_base, c: tl.constexpr, mask_h, stride_qd, L: tl.constexpr, CH: tl.constexpr,
             IS_FP8: tl.constexpr, FP8_FP16: tl.constexpr):
    cols = c * CH + tl.arange(0, CH)
    q = tl.load(q_base + cols[None, :] * stride_qd, mask=mask_h[:, None] & (cols < L)[None, :],
                other=0.0)
    return _q_operand(q, IS_FP8, FP8_FP16)


@triton.jit
def _kv_chunk(kv_rows, c: tl.constexpr, valid, stride_kvd, L: tl.constexpr, CH: tl.constexpr,
              dtype, IS_FP8: tl.constexpr, FP8_PTX: tl.constexpr):
    cols = c * CH + tl.arange(0, CH)
    kv = tl.load(kv_rows + cols[None, :] * stride_kvd, mask=valid[:, None] & (cols < L)[None, :],
                 other=0.0)
    if IS_FP8:
        kv = _widen_kv(kv, dtype, FP8_PTX)
    return kv


@triton.jit
def _store_chunk(o_rows, acc, l_safe, c: tl.constexpr, mask_h, stride_ol, L: tl.constexpr,
                 CH: tl.constexpr):
    cols = c * CH + tl.arange(0, CH)
    tl.store(o_rows + cols[None, :] * stride_ol, (acc / l_safe[:, None]).to(o_rows.dtype.element_ty),
             mask=mask_h[:, None] & (cols < L)[None, :])


@triton.jit
def _mla_sparse_chunked_kernel(
    q_ptr, kv_ptr, scale_ptr, slots_ptr, o_ptr, lse_ptr, qk_scale, H, K, num_splits,
    stride_qn, stride_qh, stride_qd,
    stride_kvp, stride_kvs, stride_kvd,
    stride_sp, stride_ss,
    stride_sln, stride_slk,
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
    FP8_FP16: tl.constexpr,
    FP8_PTX: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SLOTS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    pid_h = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_n = tl.program_id(2).to(tl.int64)
    slot_row, start, end, chosen = _split_slots(slots_ptr, pid_n, pid_s, K, num_splits,
                                                stride_sln, stride_slk, BLOCK_N, SLOTS)
    CH: tl.constexpr = BLOCK_L // CHUNKS

    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    q_base = q_ptr + pid_n * stride_qn + offs_h[:, None] * stride_qh
    q0 = _q_chunk(q_base, 0, mask_h, stride_qd, L, CH, IS_FP8, FP8_FP16)
    q1 = _q_chunk(q_base, 1, mask_h, stride_qd, L, CH, IS_FP8, FP8_FP16)
    q2 = _q_chunk(q_base, 2, mask_h, stride_qd, L, CH, IS_FP8, FP8_FP16)
    q3 = _q_chunk(q_base, 3, mask_h, stride_qd, L, CH, IS_FP8, FP8_FP16)
    q_rope = tl.load(q_base + (L + offs_r)[None, :] * stride_qd,
                     mask=mask_h[:, None] & mask_r[None, :], other=0.0)
    q_rope = _q_operand(q_rope, IS_FP8, FP8_FP16)
    acc0 = tl.zeros((BLOCK_H, CH), tl.float32)
    acc1 = tl.zeros((BLOCK_H, CH), tl.float32)
    acc2 = tl.zeros((BLOCK_H, CH), tl.float32)
    acc3 = tl.zeros((BLOCK_H, CH), tl.float32)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)

    for j0 in range(start, end, BLOCK_N):
        slot, valid = _tile_slots(chosen, slot_row, j0, start, end, stride_slk, BLOCK_N, SLOTS)
        kv_rows = kv_ptr + ((slot // PAGE_SIZE) * stride_kvp
                            + (slot % PAGE_SIZE) * stride_kvs)[:, None]
        kv0 = _kv_chunk(kv_rows, 0, valid, stride_kvd, L, CH, q0.dtype, IS_FP8, FP8_PTX)
        kv1 = _kv_chunk(kv_rows, 1, valid, stride_kvd, L, CH, q0.dtype, IS_FP8, FP8_PTX)
        kv2 = _kv_chunk(kv_rows, 2, valid, stride_kvd, L, CH, q0.dtype, IS_FP8, FP8_PTX)
        kv3 = _kv_chunk(kv_rows, 3, valid, stride_kvd, L, CH, q0.dtype, IS_FP8, FP8_PTX)
        kv_rope = tl.load(kv_rows + (L + offs_r)[None, :] * stride_kvd,
                          mask=valid[:, None] & mask_r[None, :], other=0.0)
        col = tl.full((BLOCK_N,), 1.0, tl.float32) * qk_scale
        if IS_FP8:
            row_scale = tl.load(scale_ptr + (slot // PAGE_SIZE) * stride_sp
                                + (slot % PAGE_SIZE) * stride_ss, mask=valid, other=0.0)
            kv_rope = kv_rope.to(q0.dtype)
            col = col * row_scale
        qk = tl.dot(q0, tl.trans(kv0), input_precision=DOT_PRECISION)
        qk = tl.dot(q1, tl.trans(kv1), qk, input_precision=DOT_PRECISION)
        qk = tl.dot(q2, tl.trans(kv2), qk, input_precision=DOT_PRECISION)
        qk = tl.dot(q3, tl.trans(kv3), qk, input_precision=DOT_PRECISION)
        qk = tl.dot(q_rope, tl.trans(kv_rope), qk, input_precision=DOT_PRECISION)
        qk = tl.where(valid[None, :], qk * col[None, :], float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IS_FP8:
            p = p * row_scale[None, :]
        acc0, acc1, acc2, acc3 = _value_chunks(p.to(kv0.dtype), alpha, kv0, kv1, kv2, kv3,
                                               acc0, acc1, acc2, acc3, DOT_PRECISION)
        m_i = m_new

    l_safe, lse = _softmax_totals(m_i, l_i)
    o_rows = o_ptr + pid_s * stride_os + pid_n * stride_on + offs_h[:, None] * stride_oh
    _store_chunk(o_rows, acc0, l_safe, 0, mask_h, stride_ol, L, CH)
    _store_chunk(o_rows, acc1, l_safe, 1, mask_h, stride_ol, L, CH)
    _store_chunk(o_rows, acc2, l_safe, 2, mask_h, stride_ol, L, CH)
    _store_chunk(o_rows, acc3, l_safe, 3, mask_h, stride_ol, L, CH)
    tl.store(lse_ptr + pid_s * stride_ls + pid_n * stride_ln + offs_h * stride_lh, lse,
             mask=mask_h)
