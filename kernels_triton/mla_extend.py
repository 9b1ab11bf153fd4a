"""Absorbed MLA chunked prefill (extend) over a paged latent KV cache.

``q`` (Nq, H, D) holds the rows of B requests: request b owns rows
[q_start_loc[b], q_start_loc[b+1]) (n_b rows), its KV history of ``seq_lens[b]`` tokens already
includes this chunk (written by ``kv_write`` before the call), and row j of it sits at absolute
position ``seq_lens[b] - n_b + j`` and attends causally to keys [0, pos]: the paged prefix and the
chunk up to itself.

A program owns ``BLOCK_M`` rows of one request and one head. It streams the keys every row of the
block sees (before the block's first position) without any mask, then the diagonal tiles with the
causal mask, through the same tile routine as ``mla_decode`` (``_attend_tile``): scores are
tensor-core dots of (BLOCK_M, L+R) rows against the (BLOCK_N, L+R) KV tile, and the value is the
tile's first L dims. Programs of the same row block and different heads are neighbours in the
grid, so they read each KV tile from L2. Row blocks run longest-first.

fp8 KV: as in ``mla_decode``, ``config["fp8_fp16"]`` (off by default: extend is compute-bound
and measured faster with products in q's dtype) runs both products on
fp16 operands: the query rows are clamped to [-65504, 65504] and cast to fp16 once per program
(an entry beyond fp16's range saturates instead of becoming inf / NaN), the fp8 tiles widen to
fp16 (natively on Hopper, where fp8 -> bf16 is emulated) and p is rounded to fp16; accumulators
stay fp32, the output keeps q's dtype, and the reference dequantises the same fp8 values.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from splash.backends import device_tuning
from splash.kernels_triton import _validate as V
from splash.kernels_triton.mla_decode_kernels import _LOG2E, _attend_tile, _q_operand
from splash.kernels_triton.mla_decode_ref import paged_rows_ref


@triton.jit(do_not_specialize=["num_m_blocks", "stride_btn"])  # ints that vary by step: one binary for all
def _mla_extend_kernel(
    q_ptr,  # (Nq, H, D)
    kv_ptr,  # (P, PS, D)
    scale_ptr,  # (P, PS) fp32, fp8 caches only
    bt_ptr,  # (B, max_pages) int
    seq_lens_ptr,  # (B,) int, KV length including the chunk
    q_start_ptr,  # (B + 1,) int
    o_ptr,  # (Nq, H, L)
    lse_ptr,  # (Nq, H) fp32
    qk_scale,  # sm_scale * log2(e)
    num_m_blocks,
    stride_qn, stride_qh, stride_qd,
    stride_kvp, stride_kvs, stride_kvd,
    stride_sp, stride_ss,
    stride_btn, stride_btp,
    stride_sl,
    stride_qs,
    stride_on, stride_oh, stride_ol,
    stride_ln, stride_lh,
    L: tl.constexpr,
    R: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    IS_FP8: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8_FP16: tl.constexpr,
    FP8_PTX: tl.constexpr,  # _widen_kv
    WARP_SPEC: tl.constexpr,  # producer/consumer warps for the unmasked KV loop (autoWS)
):
    pid_h = tl.program_id(0)
    pid_m = num_m_blocks - 1 - tl.program_id(1)  # the longest (last) row blocks start first
    pid_b = tl.program_id(2)

    row_start = tl.load(q_start_ptr + pid_b * stride_qs).to(tl.int32)
    n_rows = tl.load(q_start_ptr + (pid_b + 1) * stride_qs).to(tl.int32) - row_start
    m0 = pid_m * BLOCK_M
    if m0 < n_rows:
        seq_len = tl.load(seq_lens_ptr + pid_b * stride_sl).to(tl.int32)
        prefix = seq_len - n_rows
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < n_rows
        q_pos = prefix + offs_m  # (BLOCK_M,) absolute positions
        offs_l = tl.arange(0, BLOCK_L)
        mask_l = offs_l < L
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        q_rows = q_ptr + (row_start + offs_m).to(tl.int64)[:, None] * stride_qn + pid_h * stride_qh
        q_nope = tl.load(
            q_rows + offs_l[None, :] * stride_qd, mask=mask_m[:, None] & mask_l[None, :], other=0.0
        )  # (BLOCK_M, BLOCK_L)
        q_rope = tl.load(
            q_rows + (L + offs_r)[None, :] * stride_qd,
            mask=mask_m[:, None] & mask_r[None, :], other=0.0,
        )  # (BLOCK_M, BLOCK_R)
        q_nope = _q_operand(q_nope, IS_FP8, FP8_FP16)
        q_rope = _q_operand(q_rope, IS_FP8, FP8_FP16)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_L), tl.float32)
        bt_row_ptr = bt_ptr + pid_b * stride_btn

        # keys before the block's first position: visible to every row, no mask
        full_end = ((prefix + m0) // BLOCK_N) * BLOCK_N
        for t0 in tl.range(0, full_end, BLOCK_N, warp_specialize=WARP_SPEC):
            m_i, l_i, acc = _attend_tile(
                q_nope, q_rope, m_i, l_i, acc, q_pos, kv_ptr, scale_ptr, bt_row_ptr,
                t0, seq_len, qk_scale,
                stride_btp, stride_kvp, stride_kvs, stride_kvd, stride_sp, stride_ss,
                L, R, PAGE_SIZE, BLOCK_N, BLOCK_L, BLOCK_R, False, IS_FP8, False,
                DOT_PRECISION, FP8_PTX,
            )
        # the diagonal: causal mask per row
        hi = tl.minimum(seq_len, prefix + m0 + BLOCK_M)
        for t0 in range(full_end, hi, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q_nope, q_rope, m_i, l_i, acc, q_pos, kv_ptr, scale_ptr, bt_row_ptr,
                t0, seq_len, qk_scale,
                stride_btp, stride_kvp, stride_kvs, stride_kvd, stride_sp, stride_ss,
                L, R, PAGE_SIZE, BLOCK_N, BLOCK_L, BLOCK_R, True, IS_FP8, True,
                DOT_PRECISION, FP8_PTX,
            )

        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / l_safe[:, None]  # (BLOCK_M, BLOCK_L)
        lse = (m_i + tl.log2(l_safe)) * 0.6931471805599453
        rows = (row_start + offs_m).to(tl.int64)
        tl.store(
            o_ptr + rows[:, None] * stride_on + pid_h * stride_oh + offs_l[None, :] * stride_ol,
            out.to(o_ptr.dtype.element_ty),
            mask=mask_m[:, None] & mask_l[None, :],
        )
        tl.store(lse_ptr + rows * stride_ln + pid_h * stride_lh, lse, mask=mask_m)


# ---------------------------------------------------------------------------------------------
# launcher

# fp32 queries on a GPU (the GPU test suite's exact-token runs): smaller tiles, one stage, so
# the fp32 tiles fit shared memory
_GPU_FP32: dict[str, Any] = {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}


def extend_config(device: torch.device, config: dict | None,
                  fp32_q: bool = False) -> dict[str, Any]:
    cfg = device_tuning(device, "mla_extend")  # the device's backend table, then ``config``
    cfg.update(config or {})
    if device.type == "cuda" and fp32_q:
        cfg.update(_GPU_FP32)  # after any config: bf16-tuned tiles overflow shared memory
    for key in ("BLOCK_M", "BLOCK_N"):
        value = cfg[key]
        if not isinstance(value, int) or value < 16 or value & (value - 1):
            raise ValueError(f"config {key}={value!r} must be a power of two >= 16")
    return cfg


def _check_extend_values(
    block_table: torch.Tensor, seq_lens: torch.Tensor, q_start_loc: torch.Tensor, Nq: int,
    page_size: int, num_pages: int,
) -> None:
    if not V.value_checks_enabled():
        return
    starts = q_start_loc.to(torch.int64)
    if int(starts[0]) != 0 or int(starts[-1]) != Nq:
        raise ValueError(
            f"q_start_loc must start at 0 and end at Nq={Nq}; got {int(starts[0])}..{int(starts[-1])}"
        )
    n_rows = starts[1:] - starts[:-1]  # (B,)
    if bool((n_rows < 0).any()):
        raise ValueError("q_start_loc must be non-decreasing")
    if bool((seq_lens.to(torch.int64) < n_rows).any()):
        raise ValueError(
            "seq_lens must include the chunk: every seq_lens[b] >= q_start_loc[b+1] - q_start_loc[b]"
        )
    V.check_paged_lengths(block_table, seq_lens, page_size, num_pages)


def mla_extend(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    q_start_loc: torch.Tensor,
    sm_scale: float,
    kv_lora_rank: int,
    kv_scale: torch.Tensor | None = None,
    config: dict | None = None,
    max_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked-prefill MLA: ``q`` (Nq, H, L+R) rows of B requests (``q_start_loc`` (B+1,)),
    ``seq_lens`` (B,) KV lengths including the chunk -> ``(out (Nq, H, L) in q.dtype,
    lse (Nq, H) fp32)``; row j of request b attends keys [0, seq_lens[b] - n_b + j].
    ``max_rows``: the most rows of any one request, when the caller knows it; None bounds it
    by Nq without a host sync (the grid then holds row blocks requests do not have)."""
    V.check_tensor("q", q, 3, V.FLOAT_DTYPES)
    dev = q.device
    kv = V.check_kv_cache(kv_cache, dev)
    V.check_kv_scale(kv, kv_scale)
    if not V.is_fp8(kv.dtype) and kv.dtype != q.dtype:
        raise ValueError(f"q is {q.dtype} but kv_cache is {kv.dtype}; they must match (or fp8 KV)")
    Nq, H, D = q.shape
    V.check_dim("q", q, 2, kv.shape[2], "the KV row width L + R of kv_cache")
    if not isinstance(kv_lora_rank, int) or not 0 < kv_lora_rank < D:
        raise ValueError(f"kv_lora_rank={kv_lora_rank!r} must be an int in (0, D={D})")
    V.check_tensor("block_table", block_table, 2, V.INDEX_DTYPES, dev)
    V.check_tensor("seq_lens", seq_lens, 1, V.INDEX_DTYPES, dev)
    V.check_tensor("q_start_loc", q_start_loc, 1, V.INDEX_DTYPES, dev)
    B = seq_lens.shape[0]
    V.check_dim("q_start_loc", q_start_loc, 0, B + 1, "B + 1 for B = len(seq_lens)")
    V.check_dim("block_table", block_table, 0, B, "one row per request")
    L, R = kv_lora_rank, D - kv_lora_rank
    P, PS = kv.shape[0], kv.shape[1]
    _check_extend_values(block_table, seq_lens, q_start_loc, Nq, PS, P)
    out = torch.empty((Nq, H, L), dtype=q.dtype, device=dev)
    lse = torch.empty((Nq, H), dtype=torch.float32, device=dev)
    if Nq == 0 or H == 0 or B == 0:
        return out, lse

    cfg = extend_config(dev, config, fp32_q=q.dtype == torch.float32)
    BLOCK_M = cfg["BLOCK_M"]
    num_m_blocks = triton.cdiv(V.row_bound(max_rows, Nq), BLOCK_M)  # of any one request
    V.check_max_rows(q_start_loc, max_rows)
    if B > 65535 or num_m_blocks > 65535:
        raise ValueError(f"mla_extend takes at most 65535 requests and row blocks; got B={B}")
    scale = kv_scale if kv_scale is not None else lse  # never read unless fp8
    is_fp8 = V.is_fp8(kv.dtype)
    fp16_products = is_fp8 and bool(cfg.get("fp8_fp16", False))
    _mla_extend_kernel[(H, num_m_blocks, B)](
        q, kv, scale, block_table, seq_lens, q_start_loc, out, lse,
        float(sm_scale) * _LOG2E, num_m_blocks,
        *q.stride(), *kv.stride(),
        *(scale.stride() if kv_scale is not None else (0, 0)),
        *block_table.stride(), seq_lens.stride(0), q_start_loc.stride(0),
        *out.stride(), *lse.stride(),
        L=L, R=R, PAGE_SIZE=PS, BLOCK_M=BLOCK_M, BLOCK_N=cfg["BLOCK_N"],
        BLOCK_L=V.next_pow2(L), BLOCK_R=V.next_pow2(R),
        IS_FP8=is_fp8,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 and not fp16_products else None,
        FP8_FP16=fp16_products, FP8_PTX=V.ptx_fp8_widen(cfg, fp16_products, kv.dtype, q.device),
        WARP_SPEC=bool(cfg.get("warp_specialize", False)),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out, lse


def mla_extend_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    q_start_loc: torch.Tensor,
    sm_scale: float,
    kv_lora_rank: int,
    kv_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of ``mla_extend`` (fp64 math, one request at a time)."""
    Nq, H, _ = q.shape
    L = kv_lora_rank
    out = torch.zeros((Nq, H, L), dtype=torch.float64, device=q.device)
    lse = torch.zeros((Nq, H), dtype=torch.float64, device=q.device)
    for b in range(seq_lens.shape[0]):
        lo, hi, length = int(q_start_loc[b]), int(q_start_loc[b + 1]), int(seq_lens[b])
        if hi == lo:
            continue
        rows = paged_rows_ref(kv_cache, kv_scale, block_table[b], length)  # (len, D)
        scores = torch.einsum("nhd,td->nht", q[lo:hi].double(), rows) * sm_scale  # (n, H, len)
        pos = length - (hi - lo) + torch.arange(hi - lo, device=q.device)  # (n,)
        hidden = torch.arange(length, device=q.device)[None, :] > pos[:, None]  # (n, len)
        scores = scores.masked_fill(hidden[:, None, :], float("-inf"))
        lse[lo:hi] = torch.logsumexp(scores, dim=-1)
        out[lo:hi] = torch.softmax(scores, dim=-1) @ rows[:, :L]  # (n, H, L)
    return out.to(q.dtype), lse.float()
