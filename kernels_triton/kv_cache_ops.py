"""Write latent rows into the paged KV cache, and read stored rows back out.

- ``kv_write`` scatters rows (M, D) to slots (``slot = page * PS + offset``; -1 skips the row).
  Into an fp8 cache it quantises each row with its own scale ``amax(|row|) / fp8_max`` (stored in
  ``kv_scale``; row = fp8 × scale; an all-zero row gets scale 0). Rows that already are fp8 of the
  cache's dtype are stored raw with the ``row_scales`` given, so a repack moves bytes exactly.
- ``quantise_rows`` quantises rows (M, D) the same way into new fp8 rows and their scales (M,)
  (the query of the many-head fp8 decode kernel).
- ``kv_gather`` reads the stored rows (M, D) of slots back, raw (and their scales for fp8): with
  ``kv_write(..., row_scales=...)`` it is the page repack of a layout switch, with no
  requantisation. A -1 slot reads as a zero row (scale 0).

Same-dtype copies run on integer views of the tensors, so they are bit-exact for every dtype
(bf16 and fp8 included, also under the Triton interpreter). A program moves ``BLOCK_M`` rows.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from splash.kernels_triton import _validate as V

_MODE_COPY, _MODE_QUANTISE, _MODE_RAW_FP8 = 0, 1, 2


@triton.jit(do_not_specialize=["M"])  # ints that vary by step: one binary for all
def _kv_write_kernel(
    kv_ptr,  # (P, PS, D)
    scale_ptr,  # (P, PS) fp32 (fp8 caches)
    rows_ptr,  # (M, D)
    row_scale_ptr,  # (M,) fp32 (raw fp8 rows)
    slots_ptr,  # (M,) int
    M,
    stride_kvp, stride_kvs, stride_kvd,
    stride_sp, stride_ss,
    stride_rm, stride_rd,
    stride_rs,
    stride_slot,
    D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MODE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    DENSE: tl.constexpr = False,  # row m to slot m (no slots read)
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    if DENSE:
        slot = tl.where(offs_m < M, offs_m, -1).to(tl.int64)
    else:
        slot = tl.load(slots_ptr + offs_m * stride_slot, mask=offs_m < M, other=-1).to(tl.int64)
    mask_m = slot >= 0  # (BLOCK_M,) -1 and rows past M are skipped
    page = slot // PAGE_SIZE
    in_page = slot % PAGE_SIZE
    mask = mask_m[:, None] & (offs_d < D)[None, :]
    rows = tl.load(
        rows_ptr + offs_m.to(tl.int64)[:, None] * stride_rm + offs_d[None, :] * stride_rd,
        mask=mask, other=0.0,
    )  # (BLOCK_M, BLOCK_D)
    dst = kv_ptr + page[:, None] * stride_kvp + in_page[:, None] * stride_kvs
    dst = dst + offs_d[None, :] * stride_kvd
    if MODE == 1:
        x = rows.to(tl.float32)
        scale = tl.max(tl.abs(x), 1) / FP8_MAX  # (BLOCK_M,)
        inv = tl.where(scale > 0.0, 1.0 / tl.where(scale > 0.0, scale, 1.0), 0.0)
        x = tl.minimum(tl.maximum(x * inv[:, None], -FP8_MAX), FP8_MAX)
        tl.store(dst, x.to(kv_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + page * stride_sp + in_page * stride_ss, scale, mask=mask_m)
    else:
        tl.store(dst, rows.to(kv_ptr.dtype.element_ty), mask=mask)
        if MODE == 2:
            scale = tl.load(row_scale_ptr + offs_m * stride_rs, mask=mask_m, other=0.0)
            tl.store(scale_ptr + page * stride_sp + in_page * stride_ss, scale, mask=mask_m)


@triton.jit(do_not_specialize=["M"])  # ints that vary by step: one binary for all
def _kv_gather_kernel(
    kv_ptr,  # (P, PS, D)
    scale_ptr,  # (P, PS) fp32 (fp8 caches)
    rows_ptr,  # (M, D) out
    row_scale_ptr,  # (M,) fp32 out
    slots_ptr,  # (M,) int
    M,
    stride_kvp, stride_kvs, stride_kvd,
    stride_sp, stride_ss,
    stride_rm, stride_rd,
    stride_rs,
    stride_slot,
    D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SCALE: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    in_range = offs_m < M
    slot = tl.load(slots_ptr + offs_m * stride_slot, mask=in_range, other=-1).to(tl.int64)
    mask_m = slot >= 0
    page = tl.where(mask_m, slot // PAGE_SIZE, 0)
    in_page = tl.where(mask_m, slot % PAGE_SIZE, 0)
    src = kv_ptr + page[:, None] * stride_kvp + in_page[:, None] * stride_kvs
    rows = tl.load(src + offs_d[None, :] * stride_kvd, mask=mask_m[:, None] & (offs_d < D)[None, :], other=0)
    tl.store(
        rows_ptr + offs_m.to(tl.int64)[:, None] * stride_rm + offs_d[None, :] * stride_rd,
        rows,
        mask=in_range[:, None] & (offs_d < D)[None, :],
    )  # -1 slots store zeros
    if HAS_SCALE:
        scale = tl.load(scale_ptr + page * stride_sp + in_page * stride_ss, mask=mask_m, other=0.0)
        tl.store(row_scale_ptr + offs_m * stride_rs, scale, mask=in_range)


# ---------------------------------------------------------------------------------------------
# launchers

_DEFAULTS: dict[str, Any] = {"BLOCK_M": 16, "num_warps": 4}


def _config(config: dict | None) -> dict[str, Any]:
    cfg = dict(_DEFAULTS)
    cfg.update(config or {})
    if not isinstance(cfg["BLOCK_M"], int) or cfg["BLOCK_M"] < 1 or cfg["BLOCK_M"] & (cfg["BLOCK_M"] - 1):
        raise ValueError(f"config BLOCK_M={cfg['BLOCK_M']!r} must be a power of two")
    return cfg


def _check_slots(slots: object, kv: torch.Tensor) -> torch.Tensor:
    s = V.check_tensor("slots", slots, 1, V.INDEX_DTYPES, kv.device)
    V.check_index_range("slots", s, kv.shape[0] * kv.shape[1], allow_neg1=True)
    return s


def kv_write(
    kv_cache: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
    *,
    row_scales: torch.Tensor | None = None,
    config: dict | None = None,
) -> None:
    """Store ``rows`` (M, D) at ``slots`` (M,) of ``kv_cache`` (P, PS, D) in place (-1 skips).
    fp8 cache: float rows are quantised per row into ``kv_scale`` (P, PS); rows already in the
    cache's fp8 dtype are stored raw with their ``row_scales`` (M,) (repack)."""
    kv = V.check_kv_cache(kv_cache)
    V.check_kv_scale(kv, kv_scale)
    V.check_tensor("rows", rows, 2, V.KV_DTYPES, kv.device)
    V.check_dim("rows", rows, 1, kv.shape[2], "the KV row width D of kv_cache")
    s = _check_slots(slots, kv)
    M = rows.shape[0]
    V.check_dim("slots", s, 0, M, "one slot per row")
    fp8 = V.is_fp8(kv.dtype)
    if V.is_fp8(rows.dtype) and rows.dtype != kv.dtype:
        raise ValueError(f"rows are {rows.dtype} but kv_cache is {kv.dtype}; fp8 rows must match")
    if fp8 and rows.dtype == kv.dtype:
        mode = _MODE_RAW_FP8
        if row_scales is None:
            raise ValueError("raw fp8 rows need their row_scales (M,) fp32")
        V.check_tensor("row_scales", row_scales, 1, (torch.float32,), kv.device)
        V.check_dim("row_scales", row_scales, 0, M, "one scale per row")
    else:
        mode = _MODE_QUANTISE if fp8 else _MODE_COPY
        if row_scales is not None:
            raise ValueError("row_scales are only for raw fp8 rows (rows in the cache's fp8 dtype)")
    if M == 0:
        return
    cfg = _config(config)
    kv_arg, rows_arg = kv, rows
    if mode != _MODE_QUANTISE and rows.dtype == kv.dtype:
        kv_arg, rows_arg = V.as_bits(kv), V.as_bits(rows)  # bit-exact copy
    scale = kv_scale if kv_scale is not None else rows  # never read unless fp8
    rscale = row_scales if row_scales is not None else s
    D, PS = kv.shape[2], kv.shape[1]
    _kv_write_kernel[(triton.cdiv(M, cfg["BLOCK_M"]),)](
        kv_arg, scale, rows_arg, rscale, s, M,
        *kv.stride(), *(kv_scale.stride() if kv_scale is not None else (0, 0)),
        *rows.stride(), rscale.stride(0), s.stride(0),
        D=D, PAGE_SIZE=PS, BLOCK_M=cfg["BLOCK_M"], BLOCK_D=V.next_pow2(D),
        MODE=mode, FP8_MAX=V.fp8_max(kv.dtype) if fp8 else 1.0,
        num_warps=cfg["num_warps"],
    )


def quantise_rows(rows: torch.Tensor, dtype: torch.dtype,
                  config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row fp8 quantisation of ``rows`` (M, D) as ``kv_write`` stores them: ``(q (M, D) of
    ``dtype``, scale (M,) fp32)`` with row ≈ q × scale (``quantise_rows_ref``, bit for bit)."""
    V.check_tensor("rows", rows, 2, V.KV_DTYPES)
    if not V.is_fp8(dtype) or V.is_fp8(rows.dtype):
        raise ValueError(f"quantise_rows takes 16/32-bit rows to an fp8 dtype, got {rows.dtype} "
                         f"-> {dtype}")
    M, D = rows.shape
    out = torch.empty((M, D), dtype=dtype, device=rows.device)
    scale = torch.empty((M,), dtype=torch.float32, device=rows.device)
    if M:
        cfg = _config(config)
        _kv_write_kernel[(triton.cdiv(M, cfg["BLOCK_M"]),)](
            out, scale, rows, scale, scale, M, 0, *out.stride(), 0, scale.stride(0),
            *rows.stride(), 0, 0, D=D, PAGE_SIZE=1 << 30, BLOCK_M=cfg["BLOCK_M"],
            BLOCK_D=V.next_pow2(D), MODE=_MODE_QUANTISE, FP8_MAX=V.fp8_max(dtype), DENSE=True,
            num_warps=cfg["num_warps"])
    return out, scale


def kv_gather(
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
    *,
    config: dict | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The stored rows (M, D) at ``slots`` (M,), raw in ``kv_cache.dtype``; for an fp8 cache
    ``(rows, scales (M,) fp32)``. A -1 slot reads as zeros (scale 0)."""
    kv = V.check_kv_cache(kv_cache)
    V.check_kv_scale(kv, kv_scale)
    s = _check_slots(slots, kv)
    M, D, PS = s.shape[0], kv.shape[2], kv.shape[1]
    rows = torch.empty((M, D), dtype=kv.dtype, device=kv.device)
    scales = torch.empty((M,), dtype=torch.float32, device=kv.device) if kv_scale is not None else None
    if M > 0:
        cfg = _config(config)
        scale = kv_scale if kv_scale is not None else s
        out_scale = scales if scales is not None else s
        _kv_gather_kernel[(triton.cdiv(M, cfg["BLOCK_M"]),)](
            V.as_bits(kv), scale, V.as_bits(rows), out_scale, s, M,
            *kv.stride(), *(kv_scale.stride() if kv_scale is not None else (0, 0)),
            *rows.stride(), out_scale.stride(0), s.stride(0),
            D=D, PAGE_SIZE=PS, BLOCK_M=cfg["BLOCK_M"], BLOCK_D=V.next_pow2(D),
            HAS_SCALE=kv_scale is not None, num_warps=cfg["num_warps"],
        )
    return rows if scales is None else (rows, scales)


# ---------------------------------------------------------------------------------------------
# references


def quantise_rows_ref(rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row fp8 quantisation: ``(q (M, D) fp8, scale (M,) fp32)`` with row ≈ q × scale."""
    x = rows.float()
    scale = x.abs().amax(dim=1) / V.fp8_max(dtype)  # (M,)
    inv = torch.where(scale > 0, 1.0 / torch.where(scale > 0, scale, 1.0), 0.0)
    limit = V.fp8_max(dtype)
    return (x * inv[:, None]).clamp(-limit, limit).to(dtype), scale


def kv_write_ref(
    kv_cache: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
    *,
    row_scales: torch.Tensor | None = None,
) -> None:
    """Torch reference of ``kv_write`` (in place)."""
    keep = slots >= 0
    idx = slots[keep].long()
    PS = kv_cache.shape[1]
    page, off = idx // PS, idx % PS
    kept = rows[keep]
    if V.is_fp8(kv_cache.dtype):
        assert kv_scale is not None, "fp8 caches carry kv_scale"
        if kept.dtype == kv_cache.dtype:
            assert row_scales is not None, "raw fp8 rows carry row_scales"
            data, scale = kept, row_scales[keep]
        else:
            data, scale = quantise_rows_ref(kept, kv_cache.dtype)
        V.as_bits(kv_cache)[page, off] = V.as_bits(data)
        kv_scale[page, off] = scale
    else:
        kv_cache[page, off] = kept.to(kv_cache.dtype)


def kv_gather_ref(
    kv_cache: torch.Tensor, slots: torch.Tensor, kv_scale: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of ``kv_gather``."""
    PS = kv_cache.shape[1]
    keep = slots >= 0
    idx = torch.where(keep, slots, 0).long()
    bits = V.as_bits(kv_cache)[idx // PS, idx % PS] * keep[:, None].to(V.as_bits(kv_cache).dtype)
    rows = bits.view(kv_cache.dtype)
    if kv_scale is None:
        return rows
    return rows, kv_scale[idx // PS, idx % PS] * keep
