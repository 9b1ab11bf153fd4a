"""Row top-k in one pass per row: a program per row streams it in tiles, for long rows of few
rows (a decode batch's indexer scores: 16 rows of 128K).

The chunked ``topk_rows`` shrinks a row chunk by chunk, pass after pass, each pass a launch
over what the last one kept (128K -> 32K -> 8K -> 2K at k = 2048). Here one program owns the
whole row: four rounds of a 256-bin histogram over the row's order-preserving integer keys
find the k-th largest value exactly (each round streams the row, counting only keys that share
the digits chosen so far), then one more stream writes the winners in column order (those
above the threshold, and ties at it in column order until k are taken). The row is read five
times, from L2 at decode sizes, and there is one launch. Results equal the chunked kernel's
(the same winners in the same column order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_KEY_MIN = tl.constexpr(-2147483648)  # below every finite value's key (and -inf's)


@triton.jit
def _keys(v):
    """Order-preserving int32 image of fp32 ``v``; -inf (never chosen) maps below all."""
    bits = v.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return tl.where(v > float("-inf"), key, _KEY_MIN)


@triton.jit
def _to_slots(idx, take, bt_ptr, req, stride_btn, stride_btp, PAGE_SIZE: tl.constexpr):
    """Token positions ``idx`` (-1: none) of request rows ``req`` -> KV slots through the block
    table (loaded only where ``take``)."""
    has_pos = idx >= 0
    pos = tl.where(has_pos, idx, 0)
    page = tl.load(bt_ptr + req * stride_btn + (pos // PAGE_SIZE) * stride_btp,
                   mask=take & has_pos, other=0)
    return tl.where(has_pos, page * PAGE_SIZE + pos % PAGE_SIZE, -1)


@triton.jit
def _topk_row_kernel(
    vals_ptr,  # (N, M) fp32
    idx_ptr,  # (N, M) int32 (HAS_INDEX)
    out_v_ptr,  # (N, K) fp32
    out_i_ptr,  # (N, K) int32
    bt_ptr,  # (B, W) int (TO_SLOTS)
    row_req_ptr,  # (N,) int (HAS_ROW_REQ)
    M,
    stride_vn, stride_vm,
    stride_in, stride_im,
    stride_ovn, stride_ovk,
    stride_oin, stride_oik,
    stride_btn, stride_btp,
    stride_rr,
    K: tl.constexpr,
    TILE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    TO_SLOTS: tl.constexpr,
    HAS_ROW_REQ: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    vals = vals_ptr + row * stride_vn
    offs = tl.arange(0, TILE)
    digits = tl.arange(0, 256)
    prefix = tl.zeros((1,), tl.uint32)
    need = tl.full((1,), K, tl.int32)  # winners still to place at or below the prefix
    for r in tl.static_range(4):
        shift = 24 - 8 * r
        hist = tl.zeros((256,), tl.int32)
        for t0 in range(0, M, TILE):
            cols = t0 + offs
            v = tl.load(vals + cols * stride_vm, mask=cols < M, other=float("-inf"))
            ukey = (_keys(v) ^ _KEY_MIN).to(tl.uint32, bitcast=True)  # unsigned order
            match = cols < M
            if r > 0:
                match = match & ((ukey >> (shift + 8)) == (prefix >> (shift + 8)))
            hist += tl.histogram(((ukey >> shift) & 255).to(tl.int32), 256, mask=match)
        at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # count >= digit
        d = tl.max(tl.where(at_least[None, :] >= need[:, None], digits[None, :], -1), 1)
        need -= tl.sum(tl.where(digits[None, :] == d[:, None], (at_least - hist)[None, :], 0), 1)
        prefix = prefix | (d.to(tl.uint32) << shift)
    thr = prefix.to(tl.int32, bitcast=True) ^ _KEY_MIN  # the k-th largest key
    if HAS_ROW_REQ:
        req = tl.load(row_req_ptr + row * stride_rr).to(tl.int64)
    else:
        req = row
    written = tl.zeros((1,), tl.int32)
    ties_seen = tl.zeros((1,), tl.int32)
    for t0 in range(0, M, TILE):
        cols = t0 + offs
        inside = cols < M
        v = tl.load(vals + cols * stride_vm, mask=inside, other=float("-inf"))
        key = _keys(v)
        tie = ((key == thr) & inside).to(tl.int32)
        tie_rank = ties_seen + tl.cumsum(tie, 0) - 1
        take = (key > thr) | ((tie > 0) & (tie_rank < need))
        if HAS_INDEX:
            idx = tl.load(idx_ptr + row * stride_in + cols * stride_im, mask=inside, other=-1)
        else:
            idx = cols
        idx = tl.where(key > _KEY_MIN, idx, -1)
        if TO_SLOTS:
            idx = _to_slots(idx, take, bt_ptr, req, stride_btn, stride_btp, PAGE_SIZE)
        dst = written + tl.cumsum(take.to(tl.int32), 0) - 1
        tl.store(out_v_ptr + row * stride_ovn + dst * stride_ovk,
                 tl.where(key > _KEY_MIN, v, float("-inf")), mask=take)
        tl.store(out_i_ptr + row * stride_oin + dst * stride_oik, idx.to(tl.int32), mask=take)
        written += tl.sum(take.to(tl.int32), 0)
        ties_seen += tl.sum(tie, 0)


def topk_by_row(v: torch.Tensor, k: int, idx: torch.Tensor | None, bt: torch.Tensor | None,
                row_req: torch.Tensor | None, page_size: int, tile: int,
                num_warps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk_rows`` for rows of at least ``k`` entries (checked by the caller), a program per
    row streaming ``tile`` entries at a time."""
    N, M = v.shape
    out_v = torch.empty((N, k), dtype=torch.float32, device=v.device)
    out_i = torch.empty((N, k), dtype=torch.int32, device=v.device)
    if N == 0:
        return out_v, out_i
    idx_arg = idx if idx is not None else out_i  # never read without HAS_INDEX
    bt_arg = bt if bt is not None else out_i
    rr = row_req if row_req is not None else out_i
    _topk_row_kernel[(N,)](
        v, idx_arg, out_v, out_i, bt_arg, rr, M,
        *v.stride(), *idx_arg.stride(), *out_v.stride(), *out_i.stride(), *bt_arg.stride(),
        rr.stride(0),
        K=k, TILE=tile, PAGE_SIZE=page_size, HAS_INDEX=idx is not None, TO_SLOTS=bt is not None,
        HAS_ROW_REQ=row_req is not None, num_warps=num_warps,
    )
    return out_v, out_i
