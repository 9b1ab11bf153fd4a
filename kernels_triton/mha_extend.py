"""Non-absorbed MLA prefill: ordinary multi-head attention over keys and values expanded from
the latent rows (k_nope = c·W_UKᵀ, v = c·W_UVᵀ per head, the rope key shared by every head).

A query row scores a key with DN + R dims (128 + 64 for DeepSeek-V3) and takes a DV-dim value
(128), where the absorbed form (``mla_extend``) spends L + R and L (576 and 512): 3.4× fewer
FLOPs per (row, key) pair, paid for by expanding each history row once per head. Serving
engines switch to this form for long prefill chunks, where the pairs outnumber the history rows.

``q`` (Nq, H, DN + R) holds the rows of B requests: request b owns rows
[q_start_loc[b], q_start_loc[b+1]) and keys [k_start[b], k_start[b] + seq_lens[b]) of
``k_nope`` (Nk, H, DN), ``k_rope`` (Nk, R) and ``v`` (Nk, H, DV): its history up to its last
row, this chunk included, in position order. Row j of request b sits at position
seq_lens[b] - n_b + j and attends keys [0, position]. A program owns ``BLOCK_M`` rows of one request and one head; it streams the keys
every row of the block sees without a mask, then the diagonal tiles with the causal mask.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from splash.backends import device_tuning
from splash.kernels_triton import _validate as V
from splash.kernels_triton.mla_decode_kernels import _LOG2E


@triton.jit
def _mha_tile(q_nope, q_rope, m_i, l_i, acc, q_pos, kn_ptr, kr_ptr, v_ptr, t0, kv_len,
              stride_kn, stride_rn, stride_vn, qk_scale,
              DN: tl.constexpr, R: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_DN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr,
              CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One key tile [t0, t0 + BLOCK_N) into the running softmax of a row block."""
    offs_t = t0 + tl.arange(0, BLOCK_N)
    rows = offs_t.to(tl.int64)
    mask_t = offs_t < kv_len
    offs_dn, offs_r, offs_dv = tl.arange(0, BLOCK_DN), tl.arange(0, BLOCK_R), tl.arange(0, BLOCK_DV)
    k_nope = tl.load(kn_ptr + rows[:, None] * stride_kn + offs_dn[None, :],
                     mask=mask_t[:, None] & (offs_dn < DN)[None, :], other=0.0)
    k_rope = tl.load(kr_ptr + rows[:, None] * stride_rn + offs_r[None, :],
                     mask=mask_t[:, None] & (offs_r < R)[None, :], other=0.0)
    v = tl.load(v_ptr + rows[:, None] * stride_vn + offs_dv[None, :],
                mask=mask_t[:, None] & (offs_dv < DV)[None, :], other=0.0)
    s = tl.dot(q_nope, tl.trans(k_nope), input_precision=DOT_PRECISION)
    s = tl.dot(q_rope, tl.trans(k_rope), s, input_precision=DOT_PRECISION) * qk_scale
    if CAUSAL:
        s = tl.where((offs_t[None, :] <= q_pos[:, None]) & mask_t[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a padded row sees no key yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["num_m_blocks"])  # ints that vary by step: one binary for all
def _mha_extend_kernel(
    q_ptr, kn_ptr, kr_ptr, v_ptr, q_start_ptr, k_start_ptr, seq_lens_ptr, o_ptr, lse_ptr,
    qk_scale, num_m_blocks,
    stride_qn, stride_qh,
    stride_kn, stride_kh,
    stride_rn,
    stride_vn, stride_vh,
    stride_on, stride_oh,
    stride_ln, stride_lh,
    DN: tl.constexpr, R: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_h = tl.program_id(0)
    pid_m = num_m_blocks - 1 - tl.program_id(1)  # the longest (last) row blocks start first
    pid_b = tl.program_id(2)
    row_start = tl.load(q_start_ptr + pid_b).to(tl.int32)
    n_rows = tl.load(q_start_ptr + pid_b + 1).to(tl.int32) - row_start
    m0 = pid_m * BLOCK_M
    if m0 < n_rows:
        k_start = tl.load(k_start_ptr + pid_b).to(tl.int64)
        kv_len = tl.load(seq_lens_ptr + pid_b).to(tl.int32)
        # causal: the keys end at the block's rows; else every row sees every key
        prefix = kv_len - n_rows if CAUSAL else kv_len
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < n_rows
        q_pos = prefix + offs_m
        offs_dn, offs_r, offs_dv = (tl.arange(0, BLOCK_DN), tl.arange(0, BLOCK_R),
                                    tl.arange(0, BLOCK_DV))
        q_rows = q_ptr + (row_start + offs_m).to(tl.int64)[:, None] * stride_qn + pid_h * stride_qh
        q_nope = tl.load(q_rows + offs_dn[None, :],
                         mask=mask_m[:, None] & (offs_dn < DN)[None, :], other=0.0)
        q_rope = tl.load(q_rows + DN + offs_r[None, :],
                         mask=mask_m[:, None] & (offs_r < R)[None, :], other=0.0)
        kn_ptr += k_start * stride_kn + pid_h * stride_kh
        kr_ptr += k_start * stride_rn
        v_ptr += k_start * stride_vn + pid_h * stride_vh
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
        # keys every row of the block sees, in whole tiles: no mask
        full_end = (tl.minimum(prefix + m0, kv_len) // BLOCK_N) * BLOCK_N
        for t0 in range(0, full_end, BLOCK_N):
            m_i, l_i, acc = _mha_tile(q_nope, q_rope, m_i, l_i, acc, q_pos, kn_ptr, kr_ptr,
                                      v_ptr, t0, kv_len, stride_kn, stride_rn, stride_vn,
                                      qk_scale, DN, R, DV, BLOCK_N, BLOCK_DN, BLOCK_R, BLOCK_DV,
                                      False, DOT_PRECISION)
        hi = tl.minimum(kv_len, prefix + m0 + BLOCK_M)
        for t0 in range(full_end, hi, BLOCK_N):
            m_i, l_i, acc = _mha_tile(q_nope, q_rope, m_i, l_i, acc, q_pos, kn_ptr, kr_ptr,
                                      v_ptr, t0, kv_len, stride_kn, stride_rn, stride_vn,
                                      qk_scale, DN, R, DV, BLOCK_N, BLOCK_DN, BLOCK_R, BLOCK_DV,
                                      True, DOT_PRECISION)
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / l_safe[:, None]
        lse = tl.where(l_i > 0.0, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        rows = (row_start + offs_m).to(tl.int64)
        tl.store(o_ptr + rows[:, None] * stride_on + pid_h * stride_oh + offs_dv[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=mask_m[:, None] & (offs_dv < DV)[None, :])
        tl.store(lse_ptr + rows * stride_ln + pid_h * stride_lh, lse, mask=mask_m)


_GPU_FP32: dict[str, Any] = {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}


def mha_extend(q: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor, v: torch.Tensor,
               q_start_loc: torch.Tensor, k_start: torch.Tensor, seq_lens: torch.Tensor,
               sm_scale: float, causal: bool = True, config: dict | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal prefill attention of ``q`` (Nq, H, DN + R) over the expanded histories
    ``k_nope`` (Nk, H, DN), ``k_rope`` (Nk, R), ``v`` (Nk, H, DV) -> (out (Nq, H, DV) in q's
    dtype, lse (Nq, H) fp32); see the module docstring for ``q_start_loc`` (B + 1,),
    ``k_start`` and ``seq_lens`` (B,). ``causal=False``: every row attends every key of its
    request (a piece of history before the chunk; partials merge with ``lse_merge``)."""
    V.check_tensor("q", q, 3, V.FLOAT_DTYPES)
    dev = q.device
    for name, t, dim in (("k_nope", k_nope, 3), ("k_rope", k_rope, 2), ("v", v, 3)):
        V.check_tensor(name, t, dim, (q.dtype,), dev)
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride in its last dim")
    Nq, H, D = q.shape
    Nk, DN, R, DV = k_nope.shape[0], k_nope.shape[2], k_rope.shape[1], v.shape[2]
    if D != DN + R or k_nope.shape[1] != H or v.shape[1] != H or v.shape[0] != Nk or \
            k_rope.shape[0] != Nk:
        raise ValueError(f"shapes disagree: q {tuple(q.shape)}, k_nope {tuple(k_nope.shape)}, "
                         f"k_rope {tuple(k_rope.shape)}, v {tuple(v.shape)}")
    if q.stride(-1) != 1:
        raise ValueError("q must have unit stride in its last dim")
    for name, loc in (("q_start_loc", q_start_loc), ("k_start", k_start),
                      ("seq_lens", seq_lens)):
        V.check_tensor(name, loc, 1, V.INDEX_DTYPES, dev)
    B = q_start_loc.shape[0] - 1
    V.check_dim("k_start", k_start, 0, B, "one per request")
    V.check_dim("seq_lens", seq_lens, 0, B, "one per request")
    out = torch.empty((Nq, H, DV), dtype=q.dtype, device=dev)
    lse = torch.empty((Nq, H), dtype=torch.float32, device=dev)
    if Nq == 0 or H == 0 or B <= 0:
        return out, lse
    cfg = device_tuning(dev, "mha_extend")  # the device's backend table, then ``config``
    cfg.update(config or {})
    if dev.type == "cuda" and q.dtype == torch.float32:
        cfg.update(_GPU_FP32)  # after any config: bf16-tuned tiles overflow shared memory
    num_m_blocks = triton.cdiv(Nq, cfg["BLOCK_M"])  # bound for any one request: no host sync
    _mha_extend_kernel[(H, num_m_blocks, B)](
        q, k_nope, k_rope, v, q_start_loc, k_start, seq_lens, out, lse,
        float(sm_scale) * _LOG2E, num_m_blocks,
        q.stride(0), q.stride(1), k_nope.stride(0), k_nope.stride(1), k_rope.stride(0),
        v.stride(0), v.stride(1), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        DN=DN, R=R, DV=DV, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        BLOCK_DN=V.next_pow2(DN), BLOCK_R=V.next_pow2(R), BLOCK_DV=V.next_pow2(DV),
        CAUSAL=bool(causal), DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out, lse


def mha_extend_ref(q: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor, v: torch.Tensor,
                   q_start_loc: torch.Tensor, k_start: torch.Tensor, seq_lens: torch.Tensor,
                   sm_scale: float, causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of ``mha_extend`` (fp64, one request at a time)."""
    Nq, H, _ = q.shape
    out = torch.zeros((Nq, H, v.shape[2]), dtype=torch.float64, device=q.device)
    lse = torch.full((Nq, H), float("-inf"), dtype=torch.float64, device=q.device)
    for b in range(q_start_loc.shape[0] - 1):
        lo, hi = int(q_start_loc[b]), int(q_start_loc[b + 1])
        k0 = int(k_start[b])
        k1 = k0 + int(seq_lens[b])
        if hi == lo:
            continue
        length = k1 - k0
        keys = torch.cat([k_nope[k0:k1].double(),
                          k_rope[k0:k1].double()[:, None, :].expand(-1, H, -1)], dim=-1)
        scores = torch.einsum("nhd,thd->nht", q[lo:hi].double(), keys) * sm_scale
        if causal:
            pos = length - (hi - lo) + torch.arange(hi - lo, device=q.device)
            hidden = torch.arange(length, device=q.device)[None, :] > pos[:, None]
            scores = scores.masked_fill(hidden[:, None, :], float("-inf"))
        if length == 0:
            continue
        lse[lo:hi] = torch.logsumexp(scores, dim=-1)
        out[lo:hi] = torch.einsum("nht,thd->nhd", torch.softmax(scores, dim=-1),
                                  v[k0:k1].double())
    return out.to(q.dtype), lse.float()
