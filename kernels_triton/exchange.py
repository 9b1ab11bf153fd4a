"""Pack and unpack kernels of the DOP exchange.

DOP sends each query row's head slice to the row's owner and the latent outputs back:

- ``gather_rows(x, index)`` packs rows into owner order: ``out = x[index]``;
- ``scatter_rows(out, index, rows)`` unpacks them: ``out[index] = rows`` (indices distinct);
- ``split_heads_to_ranks(x, T)``: (n, H, d) -> (T, n, H/T, d), rank t's heads [t·H/T, (t+1)·H/T)
  as one contiguous block per destination (the all-to-all's send buffer);
- ``merge_heads_from_ranks(x, T)``: the inverse, (T, n, H/T, d) -> (n, H, d).

All four move bits without looking at them: they run on integer views, so every dtype (bf16 and
fp8 included) is copied exactly. A row of x is its trailing dims, which must be dense; a program
copies a (BLOCK_M rows × BLOCK_W elements) tile.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from splash.kernels_triton import _validate as V


@triton.jit
def _indexed_rows_kernel(
    src_ptr,  # (N_src, W)
    dst_ptr,  # (N_dst, W)
    index_ptr,  # (M,) int
    M,
    W,
    stride_src,
    stride_dst,
    stride_idx,
    GATHER: tl.constexpr,  # True: dst[m] = src[index[m]]; False: dst[index[m]] = src[m]
    BLOCK_M: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    mask_m = offs_m < M
    idx = tl.load(index_ptr + offs_m * stride_idx, mask=mask_m, other=0).to(tl.int64)
    if GATHER:
        src_rows = idx * stride_src
        dst_rows = offs_m.to(tl.int64) * stride_dst
    else:
        src_rows = offs_m.to(tl.int64) * stride_src
        dst_rows = idx * stride_dst
    mask = mask_m[:, None] & (offs_w < W)[None, :]
    x = tl.load(src_ptr + src_rows[:, None] + offs_w[None, :], mask=mask)
    tl.store(dst_ptr + dst_rows[:, None] + offs_w[None, :], x, mask=mask)


@triton.jit
def _head_blocks_kernel(
    src_ptr,
    dst_ptr,
    n,
    W,  # elements per (rank, row) block: H/T * d
    stride_src_t, stride_src_i,
    stride_dst_t, stride_dst_i,
    BLOCK_M: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """Copy the (t, i) blocks of W contiguous elements: dst[t, i] = src[t, i] under the strides."""
    pid_t = tl.program_id(0).to(tl.int64)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_w = tl.program_id(2) * BLOCK_W + tl.arange(0, BLOCK_W)
    rows = offs_m.to(tl.int64)
    mask = (offs_m < n)[:, None] & (offs_w < W)[None, :]
    src = src_ptr + pid_t * stride_src_t + rows[:, None] * stride_src_i + offs_w[None, :]
    dst = dst_ptr + pid_t * stride_dst_t + rows[:, None] * stride_dst_i + offs_w[None, :]
    tl.store(dst, tl.load(src, mask=mask), mask=mask)


# ---------------------------------------------------------------------------------------------
# launchers

_DEFAULTS: dict[str, Any] = {"BLOCK_M": 4, "BLOCK_W": 1024, "num_warps": 4}


def _config(config: dict | None) -> dict[str, Any]:
    cfg = dict(_DEFAULTS)
    cfg.update(config or {})
    for key in ("BLOCK_M", "BLOCK_W"):
        v = cfg[key]
        if not isinstance(v, int) or v < 1 or v & (v - 1):
            raise ValueError(f"config {key}={v!r} must be a power of two")
    return cfg


def _block_w(W: int, cfg: dict[str, Any]) -> int:
    return min(cfg["BLOCK_W"], V.next_pow2(W, 16))


def _row_width(name: str, x: torch.Tensor) -> int:
    V.check_rows_contiguous(name, x)
    width = 1
    for size in x.shape[1:]:
        width *= size
    return width


def _check_x(name: str, x: object, min_dim: int = 1) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dims, got shape {tuple(x.shape)}")
    return x


def _launch_indexed(src, dst, index, gather: bool, config: dict | None) -> None:
    M = index.shape[0]
    W = _row_width("src", src)
    if _row_width("dst", dst) != W:
        raise ValueError(f"rows of {W} and {_row_width('dst', dst)} elements")
    if M == 0 or W == 0:
        return
    cfg = _config(config)
    block_w = _block_w(W, cfg)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]), triton.cdiv(W, block_w))
    _indexed_rows_kernel[grid](
        V.as_bits(src), V.as_bits(dst), index, M, W,
        src.stride(0) if src.shape[0] > 1 else W, dst.stride(0) if dst.shape[0] > 1 else W,
        index.stride(0), GATHER=gather, BLOCK_M=cfg["BLOCK_M"], BLOCK_W=block_w,
        num_warps=cfg["num_warps"],
    )


def gather_rows(x: torch.Tensor, index: torch.Tensor, config: dict | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``x[index]`` for ``x`` (N, ...) and ``index`` (M,) int in [0, N): out (M, ...).

    ``out``, when given, receives the rows: (M, ...) of x's dtype whose rows may be strided
    (a column slice of a wider buffer, as a switch packs every pool of a row side by side)."""
    _check_x("x", x)
    V.check_tensor("index", index, 1, V.INDEX_DTYPES, x.device)
    V.check_index_range("index", index, x.shape[0], allow_neg1=False)
    shape = (index.shape[0], *x.shape[1:])
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"out is {out.dtype} {tuple(out.shape)} on {out.device}; expected "
                         f"{x.dtype} {shape} on {x.device}")
    _launch_indexed(x, out, index, True, config)
    return out


def scatter_rows(
    out: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, config: dict | None = None
) -> torch.Tensor:
    """``out[index] = rows`` in place for ``out`` (N, ...), ``index`` (M,) distinct ints in
    [0, N), ``rows`` (M, ...) (its rows may be strided); returns ``out``."""
    _check_x("out", out)
    V.check_tensor("index", index, 1, V.INDEX_DTYPES, out.device)
    _check_x("rows", rows)
    if rows.device != out.device:
        raise ValueError(f"rows are on {rows.device} but out is on {out.device}")
    if rows.dtype != out.dtype:
        raise ValueError(f"rows are {rows.dtype} but out is {out.dtype}")
    if tuple(rows.shape) != (index.shape[0], *out.shape[1:]):
        raise ValueError(
            f"rows have shape {tuple(rows.shape)}; expected {(index.shape[0], *out.shape[1:])}"
        )
    V.check_index_range("index", index, out.shape[0], allow_neg1=False)
    _launch_indexed(rows, out, index, False, config)
    return out


def _check_heads(name: str, x: object, ndim: int, T: int) -> torch.Tensor:
    t = V.check_tensor(name, x, ndim)
    if not isinstance(T, int) or T < 1:
        raise ValueError(f"T={T!r} must be a positive int")
    V.check_rows_contiguous(name, t)
    return t


def _launch_blocks(src, dst, T, n, W, src_strides, dst_strides, config) -> None:
    if T * n == 0 or W == 0:
        return
    cfg = _config(config)
    block_w = _block_w(W, cfg)
    grid = (T, triton.cdiv(n, cfg["BLOCK_M"]), triton.cdiv(W, block_w))
    _head_blocks_kernel[grid](
        V.as_bits(src), V.as_bits(dst), n, W, *src_strides, *dst_strides,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_W=block_w, num_warps=cfg["num_warps"],
    )


def split_heads_to_ranks(x: torch.Tensor, T: int, config: dict | None = None) -> torch.Tensor:
    """(n, H, d) -> (T, n, H/T, d): out[t, i] = x[i, t·H/T:(t+1)·H/T]."""
    _check_heads("x", x, 3, T)
    n, H, d = x.shape
    if H % T:
        raise ValueError(f"H={H} heads do not split evenly over T={T} ranks")
    h = H // T
    out = torch.empty((T, n, h, d), dtype=x.dtype, device=x.device)
    # block (t, i) starts at x + i*stride0 + t*h*d and at out + t*n*h*d + i*h*d
    _launch_blocks(x, out, T, n, h * d, (h * d, x.stride(0)), (n * h * d, h * d), config)
    return out


def merge_heads_from_ranks(x: torch.Tensor, T: int, config: dict | None = None) -> torch.Tensor:
    """(T, n, H/T, d) -> (n, H, d): out[i, t·H/T:(t+1)·H/T] = x[t, i]."""
    _check_heads("x", x, 4, T)
    if x.shape[0] != T:
        raise ValueError(f"x has {x.shape[0]} rank blocks in dim 0 (shape {tuple(x.shape)}); expected T={T}")
    _, n, h, d = x.shape
    out = torch.empty((n, T * h, d), dtype=x.dtype, device=x.device)
    _launch_blocks(x, out, T, n, h * d, (x.stride(0), x.stride(1)), (h * d, T * h * d), config)
    return out


# ---------------------------------------------------------------------------------------------
# references


def gather_rows_ref(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return x[index.long()]


def scatter_rows_ref(out: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    out[index.long()] = rows
    return out


def split_heads_to_ranks_ref(x: torch.Tensor, T: int) -> torch.Tensor:
    n, H, d = x.shape
    return x.reshape(n, T, H // T, d).permute(1, 0, 2, 3).contiguous()  # (T, n, H/T, d)


def merge_heads_from_ranks_ref(x: torch.Tensor, T: int) -> torch.Tensor:
    _, n, h, d = x.shape
    return x.permute(1, 0, 2, 3).reshape(n, T * h, d)  # (n, H, d)
