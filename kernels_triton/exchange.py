"""Pack and unpack kernels of the DOP exchange.

DOP sends each query row's head slice to the row's owner and the latent outputs back:

- ``gather_rows(x, index)`` packs rows into owner order: ``out = x[index]``;
- ``scatter_rows(out, index, rows)`` unpacks them: ``out[index] = rows`` (indices distinct);
- ``split_heads_to_ranks(x, T)``: (n, H, d) -> (T, n, H/T, d), rank t's heads [t·H/T, (t+1)·H/T)
  as one contiguous block per destination (the all-to-all's send buffer);
- ``merge_heads_from_ranks(x, T)``: the inverse, (T, n, H/T, d) -> (n, H, d);
- ``gather_layer_rows`` / ``scatter_layer_rows``: the same, over the same rows of L pools
  stacked at one stride (a switch packs every layer of a group in one launch);
- ``expand_runs(runs, total)``: row runs (start, n) -> the row index of every row, in order
  (a switch's send and receive slots: only the runs cross to the device, the rows are written
  there, one program per run and block of rows).

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


@triton.jit(do_not_specialize=["M"])  # ints that vary by step: one binary for all
def _indexed_rows_kernel(
    src_ptr,  # (N_src, W)
    dst_ptr,  # (N_dst, W)
    index_ptr,  # (M,) int
    M,
    W,
    stride_src,
    stride_dst,
    stride_idx,
    layer_src,  # per program_id(2): how far src and dst move (layered rows; 0 with one layer)
    layer_dst,
    GATHER: tl.constexpr,  # True: dst[m] = src[index[m]]; False: dst[index[m]] = src[m]
    BLOCK_M: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    layer = tl.program_id(2).to(tl.int64)
    src_ptr += layer * layer_src
    dst_ptr += layer * layer_dst
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


@triton.jit(do_not_specialize=["n"])  # ints that vary by step: one binary for all
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


@triton.jit
def _expand_runs_kernel(runs_ptr, out_ptr, BLOCK: tl.constexpr):
    """Run r of the (R, 3) table [start, first, n]: out[first + j] = start + j, j < n."""
    r = tl.program_id(0).to(tl.int64)
    start = tl.load(runs_ptr + r * 3)
    first = tl.load(runs_ptr + r * 3 + 1)
    n = tl.load(runs_ptr + r * 3 + 2)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + first + offs, start + offs, mask=offs < n)


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


def _launch_indexed(src, dst, index, gather: bool, config: dict | None,
                    layers: tuple[int, int, int] = (1, 0, 0)) -> None:
    """``layers``: (count, src step, dst step) in elements, one grid plane per layer."""
    M = index.shape[0]
    W = _row_width("src", src)
    if _row_width("dst", dst) != W:
        raise ValueError(f"rows of {W} and {_row_width('dst', dst)} elements")
    if M == 0 or W == 0 or layers[0] == 0:
        return
    cfg = _config(config)
    block_w = _block_w(W, cfg)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]), triton.cdiv(W, block_w), layers[0])
    _indexed_rows_kernel[grid](
        V.as_bits(src), V.as_bits(dst), index, M, W,
        src.stride(0) if src.shape[0] > 1 else W, dst.stride(0) if dst.shape[0] > 1 else W,
        index.stride(0), layers[1], layers[2], GATHER=gather, BLOCK_M=cfg["BLOCK_M"],
        BLOCK_W=block_w, num_warps=cfg["num_warps"],
    )


def _layered(x: torch.Tensor, rows: torch.Tensor, name: str) -> tuple[int, ...]:
    """Check ``x`` (L, N, ...) against ``rows`` (M, L, ...): the same layer count and row
    shape, rows dense within each; returns the row shape."""
    _check_x(name, x, 2)
    _check_x("rows", rows, 2)
    if x.device != rows.device or x.dtype != rows.dtype:
        raise ValueError(f"rows are {rows.dtype} on {rows.device} but {name} is {x.dtype} on "
                         f"{x.device}")
    if rows.shape[1] != x.shape[0] or tuple(rows.shape[2:]) != tuple(x.shape[2:]):
        raise ValueError(f"rows have shape {tuple(rows.shape)}; expected (M, {x.shape[0]}, "
                         f"{', '.join(map(str, x.shape[2:]))}) for {name} {tuple(x.shape)}")
    V.check_rows_contiguous(name, x[0])
    V.check_rows_contiguous("rows", rows[:, 0])
    return tuple(x.shape[2:])


def gather_layer_rows(x: torch.Tensor, index: torch.Tensor, out: torch.Tensor,
                      config: dict | None = None) -> torch.Tensor:
    """``out[m, l] = x[l, index[m]]`` for ``x`` (L, N, ...) — the same rows of L pools that are
    views at one stride of a stacked tensor — into ``out`` (M, L, ...) (strided: each layer's
    block a column slice of a packed row), in one launch. Returns ``out``."""
    _layered(x, out, "x")
    V.check_tensor("index", index, 1, V.INDEX_DTYPES, x.device)
    if out.shape[0] != index.shape[0]:
        raise ValueError(f"out has {out.shape[0]} rows for {index.shape[0]} indices")
    V.check_index_range("index", index, x.shape[1], allow_neg1=False)
    _launch_indexed(x[0], out[:, 0], index, True, config,
                    (x.shape[0], x.stride(0), out.stride(1)))
    return out


def scatter_layer_rows(x: torch.Tensor, index: torch.Tensor, rows: torch.Tensor,
                       config: dict | None = None) -> torch.Tensor:
    """``x[l, index[m]] = rows[m, l]`` in place: the inverse of ``gather_layer_rows`` (indices
    distinct). Returns ``x``."""
    _layered(x, rows, "x")
    V.check_tensor("index", index, 1, V.INDEX_DTYPES, x.device)
    if rows.shape[0] != index.shape[0]:
        raise ValueError(f"rows has {rows.shape[0]} rows for {index.shape[0]} indices")
    V.check_index_range("index", index, x.shape[1], allow_neg1=False)
    _launch_indexed(rows[:, 0], x[0], index, False, config,
                    (x.shape[0], rows.stride(1), x.stride(0)))
    return x


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


EXPAND_BLOCK = 256  # rows per program of ``expand_runs``


def expand_runs(runs: torch.Tensor, total: int, longest: int) -> torch.Tensor:
    """The row indices of ``runs`` (R, 3) int64 [start, first, n] (``first``: where the run's
    rows begin in the output, the runs' exclusive prefix sum of n): (total,) int64 with
    out[first + j] = start + j for j < n. ``longest``: the largest n (sizes the grid; the host
    knows it, so nothing is read back)."""
    V.check_tensor("runs", runs, 2, (torch.int64,))
    if runs.shape[1] != 3:
        raise ValueError(f"runs has shape {tuple(runs.shape)}; expected (R, 3) [start, first, n]")
    if not runs.is_contiguous():
        raise ValueError("runs must be contiguous")
    out = torch.empty(total, dtype=torch.int64, device=runs.device)
    if total and runs.shape[0]:
        grid = (runs.shape[0], triton.cdiv(max(longest, 1), EXPAND_BLOCK))
        _expand_runs_kernel[grid](runs, out, BLOCK=EXPAND_BLOCK)
    return out


# ---------------------------------------------------------------------------------------------
# references


def expand_runs_ref(runs: torch.Tensor, total: int) -> torch.Tensor:
    out = torch.empty(total, dtype=torch.int64, device=runs.device)
    for start, first, n in runs.tolist():
        out[first: first + n] = torch.arange(start, start + n)
    return out


def gather_layer_rows_ref(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return x[:, index.long()].transpose(0, 1)


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
