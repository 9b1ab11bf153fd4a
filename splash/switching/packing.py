"""The packed row of a switch's layer group: every per-slot pool of every layer of the group
side by side, so one buffer row carries a slot's whole state and one collective moves it.

Kind by kind (latent rows, fp8 scales, indexer keys, their scales), layer by layer within a
kind, each block on an 8-byte boundary; a kind whose pools are views of one tensor at one
stride (the worker allocates them so) packs and unpacks in one launch of the exchange kernels,
in the widest integer word both sides allow (raw bytes: nothing is requantised).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from splash.kernels_triton import gather_layer_rows, scatter_layer_rows

_WORDS = (torch.int64, torch.int32, torch.int16)


def _word(*views: torch.Tensor) -> torch.dtype:
    """The widest integer word dividing every byte view's last dim, other strides and
    address."""
    for word in _WORDS:
        k = word.itemsize
        if all(v.shape[-1] % k == 0 and v.data_ptr() % k == 0 and
               all(st % k == 0 for st in v.stride()[:-1]) for v in views):
            return word
    return torch.uint8


def _pool_rows(pool: torch.Tensor) -> torch.Tensor:
    """(P, PS, D) or (P, PS) pool as (P*PS, bytes per row), sharing storage."""
    return pool.reshape(pool.shape[0] * pool.shape[1], -1).view(torch.uint8)


def _pad8(n: int) -> int:
    return -(-n // 8) * 8


class _Block(NamedTuple):
    """Where L pools' rows sit in a packed row: layer j's bytes at ``col + j * step``."""

    rows: torch.Tensor  # (L, rows, width) bytes: pools that are views at one stride
    col: int
    width: int
    step: int  # the width padded to 8 bytes


def _stacked(pools: list[torch.Tensor]) -> torch.Tensor | None:
    """(L, rows, width) byte rows of ``pools`` when they are views of one tensor at one
    stride (the worker allocates each kind of pool for all layers at once), else None."""
    first = _pool_rows(pools[0])
    ptrs = [p.data_ptr() for p in pools]
    step = ptrs[1] - ptrs[0] if len(pools) > 1 else 0
    base = pools[0].untyped_storage().data_ptr()
    if len(pools) > 1 and (step <= 0 or any(b - a != step for a, b in zip(ptrs, ptrs[1:])) or
                           any(p.shape != pools[0].shape or p.dtype != pools[0].dtype or
                               p.stride() != pools[0].stride() or
                               p.untyped_storage().data_ptr() != base for p in pools)):
        return None
    return torch.as_strided(first, (len(pools), *first.shape), (step, *first.stride()))


def row_layout(kinds: list[list[torch.Tensor]]) -> tuple[list[_Block], int]:
    """The packed row of a layer group: kind by kind (latent rows, fp8 scales, indexer keys,
    their scales), layer by layer within a kind; every block starts on an 8-byte boundary, so
    a 1,152-byte latent row moves as 144 int64 words even beside a 4-byte fp8 scale. The
    columns do not depend on how the pools are allocated; the launches do (one per kind when
    its pools are stacked, else one per pool)."""
    out, col = [], 0
    for pools in kinds:
        if not pools:
            continue
        stacked = _stacked(pools)
        for rows in [stacked] if stacked is not None else [_pool_rows(p)[None] for p in pools]:
            step = _pad8(rows.shape[2])
            out.append(_Block(rows, col, rows.shape[2], step))
            col += step * rows.shape[0]
    return out, col


def _columns(b: _Block, buf: torch.Tensor) -> torch.Tensor:
    """``b``'s part of every packed row of ``buf``: (rows, L, width) bytes."""
    layers = b.rows.shape[0]
    return buf[:, b.col: b.col + b.step * layers].view(buf.shape[0], layers, b.step)[
        :, :, :b.width]


def pack(b: _Block, slots: torch.Tensor, buf: torch.Tensor) -> None:
    """buf's columns of ``b`` = its pools' rows at ``slots`` (bytes), in the widest word both
    sides allow."""
    dst = _columns(b, buf)
    word = _word(b.rows, dst)
    gather_layer_rows(b.rows.view(word), slots, dst.view(word))


def unpack(b: _Block, slots: torch.Tensor, buf: torch.Tensor) -> None:
    """``b``'s pools' rows at ``slots`` = buf's columns of ``b``."""
    src = _columns(b, buf)
    word = _word(b.rows, src)
    scatter_layer_rows(b.rows.view(word), slots, src.view(word))
