"""Absorbed MLA over selected KV slots (DeepSeek Sparse Attention's attention half).

Each query row n attends only the latent rows at ``slots[n, :]`` (``page * PS + offset`` in the
pool; -1 entries are skipped), the positions its indexer chose:

    out[n, h] = softmax_j(sm_scale * q[n, h] · kv[slots[n, j]]) @ kv[slots[n, j], :L]

with ``lse`` the natural log of the softmax denominator (-inf and out 0 when a row selects
nothing). The same kernel serves decode and prefill rows: causality is already in the
selection. A program owns a head group of ``BLOCK_H`` heads of one row and one split of its
slot list, and folds ``BLOCK_N`` gathered rows at a time into an online softmax with
tensor-core dots (scores = q_nope·kv_nopeᵀ + q_rope·kv_ropeᵀ, acc += p·kv_nope), as
``mla_decode`` does over a block table; split partials merge with ``lse_merge``'s kernel.
fp8 KV: a row is fp8 × its fp32 scale; the tile widens exactly to the products' dtype (fp16
under ``config["fp8_fp16"]``, the CUDA default, with q clamped to fp16's range) and the scale
multiplies the score column and p's column.

``config["gather_slots"]`` (the CUDA default but for bf16 KV at many heads): a program loads
its split's slot ids once (at most 512) and gathers each tile's from registers instead of
loading them in the loop, where the tile's addresses wait on that load and Triton's pipeliner
(3.6) then runs no copy ahead (offline sm_90: with it and 3 stages the loop keeps two copy
groups in flight; without, every iteration waits for all). On an H200 (16 rows x 2,048
selected rows): 16 heads 3-7% faster, 128 heads fp8 9% faster, 128 heads bf16 3% slower.

``config["dim_chunks"]`` (the CUDA default, latents of 64 columns or more): the latent dims in
four column chunks (``mla_sparse_chunked``), 9-13% faster on an H200 at 16 and 128 heads.

``config["gluon"]`` (Hopper; the CUDA default at many heads with bf16 KV when a split holds at
least ``gluon_min_split_tiles`` tiles): the Gluon decode kernels serve the selection, each
tile's 64 rows gathered by cp.async into the swizzled stages the products read (rows of -1 or
past the list arrive as zeros), one program an SM over a split of the row's list, then
``lse_merge``. H200, batch 16 x 2,048 selected rows (``dsa_sparse_gluon*.json``, against the
Triton kernel in the same run): 128 heads bf16 0.0519 -> 0.0418 ms (8 tiles a split); 64
heads 0.0292 -> 0.0300 and 16 heads 0.0163 -> 0.0171 (4 tiles a split: the copies have no
time to overlap), so the tuning table keeps the Triton kernel there. e4m3 KV at many heads:
the warp-specialised kernel (``mla_decode_heads_fp8_ws``, its widening warpgroup gathering
the rows), H100 128 heads 0.0680 -> 0.0441 ms (``results/h100/dsa_sparse_fp8_ws.json``), 64
heads at 4 tiles a split 0.0430 -> 0.0351 (``dsa_sparse_fp8_16_64.json``); it reads q in e4m3
(``query_as_read``); at few heads the Triton kernel (the Gluon forms widen serially: 0.0194
-> 0.0272 on an H200, 0.0196 -> 0.0288 on an H100 with 16-byte gathers).

Tried at 16 heads (``dsa_sparse_prefetch_tried.json``): each split's selected rows asked of
L2 at its start (one bulk prefetch a row), 0.0162 -> 0.0189 ms bf16, and 32-token tiles in 4
or 5 stages, 0.018: the default's two tiles in flight already keep the copies going.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from splash.backends import device_tuning
from splash.kernels_triton import _validate as V
from splash.kernels_triton import mla_decode_heads_fp8_ws as heads_fp8_ws
from splash.kernels_triton import mla_decode_heads_gluon as heads_gluon
from splash.kernels_triton import mla_decode_tokens_gluon as tokens_gluon
from splash.kernels_triton.lse_merge import _merge_into
from splash.kernels_triton.mla_decode import (
    choose_num_splits,
    decode_config,
    e4m3_query,
    gluon_form,
)
from splash.kernels_triton.mla_decode_gluon_tiles import BN as GLUON_TILE
from splash.kernels_triton.mla_decode_kernels import (
    _LOG2E,
    _q_operand,
    _softmax_totals,
    _widen_kv,
)
from splash.kernels_triton.mla_sparse_chunked import CHUNKS, _mla_sparse_chunked_kernel
from splash.kernels_triton.paged_ids import _split_slots, _tile_slots
from splash.kernels_triton.pdl import pdl, pdl_enter


@triton.jit
def _mla_sparse_kernel(
    q_ptr,  # (N, H, D)
    kv_ptr,  # (P, PS, D)
    scale_ptr,  # (P, PS) fp32, fp8 caches only
    slots_ptr,  # (N, K) int
    o_ptr,  # (S, N, H, L) fp32 partials, or (N, H, L) output when S == 1
    lse_ptr,  # (S, N, H) fp32, or (N, H)
    qk_scale,  # sm_scale * log2(e)
    H,
    K,
    num_splits,
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
    FP8_PTX: tl.constexpr,  # _widen_kv
    DOT_PRECISION: tl.constexpr,
    SLOTS: tl.constexpr,  # > 0: a split's slot ids (at most SLOTS) loaded once and gathered
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    pid_h = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_n = tl.program_id(2).to(tl.int64)
    slot_row, start, end, chosen = _split_slots(slots_ptr, pid_n, pid_s, K, num_splits,
                                                stride_sln, stride_slk, BLOCK_N, SLOTS)

    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_l = tl.arange(0, BLOCK_L)
    mask_l = offs_l < L
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    q_base = q_ptr + pid_n * stride_qn + offs_h[:, None] * stride_qh
    q_nope = tl.load(q_base + offs_l[None, :] * stride_qd,
                     mask=mask_h[:, None] & mask_l[None, :], other=0.0)  # (BLOCK_H, BLOCK_L)
    q_rope = tl.load(q_base + (L + offs_r)[None, :] * stride_qd,
                     mask=mask_h[:, None] & mask_r[None, :], other=0.0)  # (BLOCK_H, BLOCK_R)
    q_nope = _q_operand(q_nope, IS_FP8, FP8_FP16)
    q_rope = _q_operand(q_rope, IS_FP8, FP8_FP16)
    acc = tl.zeros((BLOCK_H, BLOCK_L), tl.float32)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)

    for j0 in range(start, end, BLOCK_N):
        slot, valid = _tile_slots(chosen, slot_row, j0, start, end, stride_slk, BLOCK_N, SLOTS)
        row_off = (slot // PAGE_SIZE) * stride_kvp + (slot % PAGE_SIZE) * stride_kvs
        kv_nope = tl.load(kv_ptr + row_off[:, None] + offs_l[None, :] * stride_kvd,
                          mask=valid[:, None] & mask_l[None, :], other=0.0)  # (BLOCK_N, BLOCK_L)
        kv_rope = tl.load(kv_ptr + row_off[:, None] + (L + offs_r)[None, :] * stride_kvd,
                          mask=valid[:, None] & mask_r[None, :], other=0.0)  # (BLOCK_N, BLOCK_R)
        col = tl.full((BLOCK_N,), 1.0, tl.float32) * qk_scale
        if IS_FP8:
            row_scale = tl.load(scale_ptr + (slot // PAGE_SIZE) * stride_sp
                                + (slot % PAGE_SIZE) * stride_ss, mask=valid, other=0.0)
            kv_nope = _widen_kv(kv_nope, q_nope.dtype, FP8_PTX)  # exact: fp8 fits fp16/bf16/fp32
            kv_rope = kv_rope.to(q_nope.dtype)
            col = col * row_scale
        qk = tl.dot(q_nope, tl.trans(kv_nope), input_precision=DOT_PRECISION)
        qk = tl.dot(q_rope, tl.trans(kv_rope), qk, input_precision=DOT_PRECISION)
        qk = tl.where(valid[None, :], qk * col[None, :], float("-inf"))  # (BLOCK_H, BLOCK_N)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # a tile of skipped slots
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IS_FP8:
            p = p * row_scale[None, :]
        acc = tl.dot(p.to(kv_nope.dtype), kv_nope, acc * alpha[:, None],
                     input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe, lse = _softmax_totals(m_i, l_i)
    out = acc / l_safe[:, None]
    o_base = o_ptr + pid_s * stride_os + pid_n * stride_on
    tl.store(o_base + offs_h[:, None] * stride_oh + offs_l[None, :] * stride_ol,
             out.to(o_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_l[None, :])
    tl.store(lse_ptr + pid_s * stride_ls + pid_n * stride_ln + offs_h * stride_lh, lse,
             mask=mask_h)


# ---------------------------------------------------------------------------------------------
# launcher


def _gathered_slots(cfg: dict[str, Any], K: int, num_splits: int, block_n: int) -> int:
    """SLOTS for ``config["gather_slots"]``: room for a split's slot ids, or 0 (ids loaded
    per tile)."""
    split_len = triton.cdiv(triton.cdiv(K, num_splits), block_n) * block_n
    return V.gathered_ids(split_len, cfg.get("gather_slots"), 512)


def mla_sparse(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    sm_scale: float,
    kv_lora_rank: int,
    kv_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse absorbed MLA: ``q`` (N, H, L+R), ``kv_cache`` (P, PS, L+R), ``slots`` (N, K) int
    (-1 skipped) -> ``(out (N, H, L) in q.dtype, lse (N, H) fp32)``. Launch parameters follow
    ``mla_decode``'s heads-on-M kernel (its tuning table, then the backend's ``mla_sparse``
    entry, then ``config``); ``num_splits=None`` picks
    the split of each row's K slots from N and the device's SM count."""
    V.check_tensor("q", q, 3, V.FLOAT_DTYPES)
    dev = q.device
    kv = V.check_kv_cache(kv_cache, dev)
    V.check_kv_scale(kv, kv_scale)
    if not V.is_fp8(kv.dtype) and kv.dtype != q.dtype:
        raise ValueError(f"q is {q.dtype} but kv_cache is {kv.dtype}; they must match (or fp8 KV)")
    N, H, D = q.shape
    V.check_dim("q", q, 2, kv.shape[2], "the KV row width L + R of kv_cache")
    if not isinstance(kv_lora_rank, int) or not 0 < kv_lora_rank < D:
        raise ValueError(f"kv_lora_rank={kv_lora_rank!r} must be an int in (0, D={D})")
    V.check_tensor("slots", slots, 2, V.INDEX_DTYPES, dev)
    V.check_dim("slots", slots, 0, N, "one slot list per query row")
    P, PS = kv.shape[0], kv.shape[1]
    V.check_index_range("slots", slots, P * PS, allow_neg1=True)
    L, R, K = kv_lora_rank, D - kv_lora_rank, slots.shape[1]
    out = torch.empty((N, H, L), dtype=q.dtype, device=dev)
    lse = torch.empty((N, H), dtype=torch.float32, device=dev)
    if N == 0 or H == 0:
        return out, lse
    if N > 65535:
        raise ValueError(f"mla_sparse takes at most 65535 rows per launch, got N={N}")
    fp8 = V.is_fp8(kv.dtype)
    cfg = _sparse_config(q, kv, config)
    block_h, block_n = cfg["BLOCK_H"], cfg["BLOCK_N"]
    head_groups = triton.cdiv(H, block_h)
    if num_splits is not None and (not isinstance(num_splits, int)
                                   or not 1 <= num_splits <= 65535):
        raise ValueError(f"num_splits={num_splits!r} must be an int in [1, 65535]")
    route = _gluon_route(q, kv, L, K, num_splits, cfg)
    if route is not None:
        _gluon_sparse(*route, q, kv, kv_scale, slots, float(sm_scale) * _LOG2E, out, lse, cfg)
        return out, lse
    if num_splits is None:
        num_splits = choose_num_splits(N, head_groups, K, dev, cfg)
    if num_splits == 1:
        o_part, lse_part, stride_os, stride_ls = out, lse, 0, 0
    else:
        o_part = torch.empty((num_splits, N, H, L), dtype=V.partial_dtype(cfg, out.dtype, num_splits),
                             device=dev)
        lse_part = torch.empty((num_splits, N, H), dtype=torch.float32, device=dev)
        stride_os, stride_ls = o_part.stride(0), lse_part.stride(0)
    fp16 = fp8 and bool(cfg.get("fp8_fp16", False))
    scale = kv_scale if kv_scale is not None else lse  # never read unless fp8
    # the chunked form takes latents of at least 16 columns a chunk (the products' K)
    chunked = bool(cfg.get("dim_chunks")) and V.next_pow2(L) >= 16 * CHUNKS.value
    kernel = _mla_sparse_chunked_kernel if chunked else _mla_sparse_kernel
    kernel[(head_groups, num_splits, N)](
        q, kv, scale, slots, o_part, lse_part, float(sm_scale) * _LOG2E, H, K, num_splits,
        *q.stride(), *kv.stride(), *(kv_scale.stride() if kv_scale is not None else (0, 0)),
        *slots.stride(), stride_os, *o_part.stride()[-3:], stride_ls, *lse_part.stride()[-2:],
        L=L, R=R, PAGE_SIZE=PS, BLOCK_H=block_h, BLOCK_N=block_n,
        BLOCK_L=V.next_pow2(L), BLOCK_R=V.next_pow2(R), IS_FP8=fp8, FP8_FP16=fp16,
        FP8_PTX=V.ptx_fp8_widen(cfg, fp16, kv.dtype, dev),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 and not fp16 else None,
        SLOTS=_gathered_slots(cfg, K, num_splits, block_n), PDL=(on := pdl(dev)), launch_pdl=on,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if num_splits > 1:
        _merge_into(o_part, lse_part, out, lse)
    return out, lse


def _sparse_config(q: torch.Tensor, kv: torch.Tensor, config: dict | None) -> dict[str, Any]:
    """Launch parameters: ``mla_decode``'s (``decode_config``) under the backend's
    ``mla_sparse`` entry, then ``config``."""
    config = {**device_tuning(q.device, "mla_sparse"), **(config or {})}
    return decode_config(q.shape[1], q.device, config, fp8=V.is_fp8(kv.dtype),
                         fp32_q=q.dtype == torch.float32)


def _gluon_route(q: torch.Tensor, kv: torch.Tensor, L: int, K: int, num_splits: int | None,
                 cfg: dict[str, Any]) -> tuple[str, tuple[int, int]] | None:
    """(Gluon form, split) where a Gluon decode kernel serves the selection: its form
    (``gluon_form``) and, unless ``num_splits`` is given, a split of at least
    ``gluon_min_split_tiles`` tiles; else None (the Triton kernels)."""
    form = gluon_form(q, kv, L, q.shape[2] - L, cfg["BLOCK_H"], cfg)
    if form is None:
        return None
    split = _gluon_split(form, q.shape[0], q.shape[1], K, q.device, num_splits)
    if num_splits is None and split[1] < int(cfg.get("gluon_min_split_tiles", 0)) * GLUON_TILE:
        return None
    return form, split


def query_as_read(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                  kv_lora_rank: int, num_splits: int | None = None,
                  config: dict | None = None) -> torch.Tensor:
    """q as ``mla_sparse`` reads it for this cache, selection, split count and config: where
    a many-head Gluon kernel serves e4m3 KV (their scores' product reads q in e4m3, a scale
    a head), q quantised so and dequantised (fp32); else q. A reference fed this checks the
    kernels alone."""
    kv = V.check_kv_cache(kv_cache, q.device)
    route = _gluon_route(q, kv, kv_lora_rank, slots.shape[1], num_splits,
                         _sparse_config(q, kv, config))
    if route is None or route[0] != "heads" or not V.is_fp8(kv.dtype):
        return q
    return e4m3_query(q, kv.dtype)


def _gluon_split(form: str, N: int, H: int, K: int, device: torch.device,
                 num_splits: int | None) -> tuple[int, int]:
    """(splits, slots a split) of each row's K slots for the Gluon kernels: whole 64-row
    tiles, ``num_splits`` or as many as fill the SMs once with one program an SM per head
    group x split x row."""
    groups = 1 if form == "tokens" else triton.cdiv(H, heads_gluon.BH)
    tiles = triton.cdiv(K, GLUON_TILE)
    if num_splits is None:
        num_splits = max(1, V.num_sms(device) // (groups * N))
    split_len = triton.cdiv(tiles, min(num_splits, tiles)) * GLUON_TILE
    return triton.cdiv(K, split_len), split_len


def _gluon_sparse(form: str, split: tuple[int, int], q: torch.Tensor, kv: torch.Tensor,
                  kv_scale: torch.Tensor | None, slots: torch.Tensor, qk_scale: float,
                  out: torch.Tensor, lse: torch.Tensor, cfg: dict[str, Any]) -> None:
    """``mla_sparse`` by a Gluon kernel over ``split`` (``_gluon_split``), then ``lse_merge``
    over the splits (partial rows in ``low_partials``' dtype)."""
    N, H, L = out.shape
    splits = split[0]
    dtype = V.partial_dtype(cfg, out.dtype, splits)
    o_part = torch.empty((splits * N, 1, H, L), dtype=dtype, device=q.device)
    lse_part = torch.empty((splits * N, 1, H), dtype=torch.float32, device=q.device)
    low = splits if dtype != torch.float32 else 0
    scale = kv_scale if kv_scale is not None else lse  # (never read without fp8 KV)
    if form == "tokens":
        tokens_gluon.launch(q, kv, scale, slots, o_part, o_part, lse_part, out, lse, None,
                            qk_scale, low, sparse=split)
    elif heads_fp8_ws.serves(kv):
        heads_fp8_ws.launch(q, kv, scale, slots, o_part, o_part, lse_part, out, lse, None,
                            qk_scale, low, sparse=split)
    else:
        heads_gluon.launch(q, kv, slots, o_part, o_part, lse_part, out, lse, None, qk_scale, low,
                           sparse=split)
    if splits > 1:
        _merge_into(o_part.view(splits, N, H, L), lse_part.view(splits, N, H), out, lse)


# ---------------------------------------------------------------------------------------------
# reference


def mla_sparse_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    sm_scale: float,
    kv_lora_rank: int,
    kv_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of ``mla_sparse`` (fp64 math, one row at a time)."""
    N, H, _ = q.shape
    PS, L = kv_cache.shape[1], kv_lora_rank
    out = torch.zeros((N, H, L), dtype=torch.float64, device=q.device)
    lse = torch.full((N, H), float("-inf"), dtype=torch.float64, device=q.device)
    for n in range(N):
        s = slots[n][slots[n] >= 0].long()
        if s.numel() == 0:
            continue
        rows = kv_cache[s // PS, s % PS].double()  # (k, D)
        if kv_scale is not None:
            rows = rows * kv_scale[s // PS, s % PS].double()[:, None]
        scores = (q[n].double() @ rows.T) * sm_scale  # (H, k)
        lse[n] = torch.logsumexp(scores, dim=-1)
        out[n] = torch.softmax(scores, dim=-1) @ rows[:, :L]
    return out.to(q.dtype), lse.float()
