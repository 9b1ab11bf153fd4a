"""``topk_rows``' passes: each is two launches, a search of every chunk's threshold, then a
program per column part placing that part's winners.

A pass compacts: a chunk's winners follow those of the chunks before it in its row (the
per-chunk counts, ``taken``, tell every program where its chunk starts), and entries never
chosen (-inf) are dropped, so the next pass reads each row only up to the sum of the counts
(chunks past it exit at once). Only the last pass pads a row to k with -1 / -inf.

The first pass may take a floor: ``G`` maxima of disjoint groups of each row's entries (the
lightning indexer's, a group of 8 tokens each). At least k entries reach the k-th largest of
any k group maxima, so every entry below a bound of it loses; the search drops those before
it looks for its chunk's threshold, and a chunk left with at most k entries (nearly all of
them, on long rows) skips the search. On iid scores with 2k groups about 1.4 k entries of the
whole row survive, so the next pass is the last one.
"""

from __future__ import annotations

import triton
import triton.language as tl

from splash.kernels_triton.pdl import pdl_enter
from splash.kernels_triton.topk_search import (
    _chunk_keys,
    _counts_before,
    _floor_key,
    _place_part,
    _row_requests,
    _threshold,
)

# ints that vary by step (lengths, chunk counts and the strides that follow them): one binary
SEARCH_INTS = ["N", "NUM_PREV", "G", "stride_mn", "stride_tn", "stride_pn", "stride_fn"]
PLACE_INTS = ["N", "NUM_PREV", "stride_btn", "stride_mn", "stride_tn", "stride_pn"]
LAST_INTS = ["N", "M", "NUM_PREV", "stride_mn", "stride_tn", "stride_pn"]


@triton.jit
def _row_limit(prev_ptr, rows, mask_r, NUM_PREV, M, stride_pn, ROWS: tl.constexpr,
               NCB: tl.constexpr, HAS_PREV: tl.constexpr):
    """Each row's valid columns: the previous pass's winners (its ``NUM_PREV`` chunk counts),
    or all ``M`` in the first pass."""
    if HAS_PREV:
        return _counts_before(prev_ptr, rows, mask_r, NUM_PREV, stride_pn, NCB)
    return tl.zeros((ROWS,), tl.int32) + M


@triton.jit
def _store_meta(meta_ptr, rows, mask_r, stride_mn, first_part, thr, room, above, ties,
                ROWS: tl.constexpr, PARTS: tl.constexpr):
    """Meta of a chunk's ``PARTS`` parts from ``first_part`` on: threshold, room, and the
    chunk's entries above and at the threshold before each part."""
    offs_p = tl.arange(0, PARTS)
    base = meta_ptr + rows[:, None] * stride_mn + (first_part + offs_p[None, :]) * 4
    zero = tl.zeros((ROWS, PARTS), tl.int32)
    keep = tl.broadcast_to(mask_r[:, None], (ROWS, PARTS))
    tl.store(base, zero + thr.to(tl.int32, bitcast=True)[:, None], mask=keep)
    tl.store(base + 1, zero + room[:, None], mask=keep)
    tl.store(base + 2, tl.cumsum(above, 1) - above, mask=keep)
    tl.store(base + 3, tl.cumsum(ties, 1) - ties, mask=keep)


@triton.jit(do_not_specialize=SEARCH_INTS)
def _topk_search_kernel(
    vals_ptr,  # (N, M) fp32
    meta_ptr,  # (N, num_chunks, PARTS, 4) int32: threshold key, room, above / ties before
    taken_ptr,  # (N, num_chunks) int32: the winners each chunk places
    prev_ptr,  # (N, NUM_PREV) int32: the previous pass's ``taken`` (HAS_PREV)
    floor_ptr,  # (N, G) fp32: group maxima (FLOOR_N > 0)
    N,
    M,
    NUM_PREV,
    G,
    stride_vn, stride_vm,
    stride_mn,  # meta is contiguous: (N, num_chunks, PARTS, 4)
    stride_tn,
    stride_pn,
    stride_fn,
    K: tl.constexpr,
    CHUNK: tl.constexpr,
    ROWS: tl.constexpr,
    PARTS: tl.constexpr,
    SECANT: tl.constexpr,
    NCB: tl.constexpr,  # a power of two >= the chunks of this pass and of the one before
    HAS_PREV: tl.constexpr,
    PAD: tl.constexpr,  # the last pass: rows padded to K
    FLOOR_N: tl.constexpr,  # > 0: the group maxima fold to this many for the floor
    FLOOR_ROUNDS: tl.constexpr,
    PDL: tl.constexpr,
):
    """A chunk's threshold, and per part of it the entries above and at it in the parts
    before (what ``_topk_place_kernel`` needs to place that part alone)."""
    pdl_enter(PDL)
    pid_c = tl.program_id(0)
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    mask_r = rows < N
    rows = rows.to(tl.int64)
    lim = _row_limit(prev_ptr, rows, mask_r, NUM_PREV, M, stride_pn, ROWS, NCB, HAS_PREV)
    ukey = _chunk_keys(vals_ptr, rows, mask_r, pid_c * CHUNK + tl.arange(0, CHUNK), lim[:, None],
                       stride_vn, stride_vm)
    if FLOOR_N > 0:  # entries below the floor cannot win
        floor = _floor_key(floor_ptr, rows, mask_r, G, stride_fn, K, ROWS, FLOOR_N,
                           FLOOR_ROUNDS)
        ukey = tl.where(ukey >= floor[:, None], ukey, tl.zeros_like(ukey))
    thr, room = _threshold(ukey, K, ROWS, SECANT)
    if not PAD:
        if FLOOR_N > 0:  # at most K entries reach the floor: they all win, the placement
            few = (thr == 0) & (floor > 0)  # (which reads the keys unfloored) cuts there
            thr = tl.where(few, floor, thr)
            room = tl.where(few, tl.sum((ukey == floor[:, None]).to(tl.int32), 1), room)
        room = tl.where(thr > 0, room, 0)  # ties at key 0 (never chosen) are not placed
    parts = tl.reshape(ukey, (ROWS, PARTS, CHUNK // PARTS))
    above = tl.sum((parts > thr[:, None, None]).to(tl.int32), 2)  # (ROWS, PARTS)
    ties = tl.sum((parts == thr[:, None, None]).to(tl.int32), 2)
    _store_meta(meta_ptr, rows, mask_r, stride_mn, pid_c * PARTS, thr, room, above, ties, ROWS,
                PARTS)
    if PAD:
        taken = tl.full((ROWS,), K, tl.int32)
    else:
        taken = tl.minimum(tl.sum((ukey > 0).to(tl.int32), 1), K)
    tl.store(taken_ptr + rows * stride_tn + pid_c, taken, mask=mask_r)


@triton.jit(do_not_specialize=PLACE_INTS)
def _topk_place_kernel(
    vals_ptr, idx_ptr, out_v_ptr, out_i_ptr, bt_ptr, row_req_ptr,
    meta_ptr,  # from _topk_search_kernel
    taken_ptr,  # from _topk_search_kernel
    prev_ptr,  # the previous pass's taken (HAS_PREV)
    N,
    M,
    NUM_PREV,
    stride_vn, stride_vm,
    stride_in, stride_im,
    stride_ovn, stride_ovk,
    stride_oin, stride_oik,
    stride_btn, stride_btp,
    stride_rr,
    stride_mn,  # meta: (N, num_chunks, PARTS, 4), contiguous
    stride_tn,
    stride_pn,
    K: tl.constexpr,
    CHUNK: tl.constexpr,
    ROWS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    TO_SLOTS: tl.constexpr,
    HAS_ROW_REQ: tl.constexpr,
    PARTS: tl.constexpr,
    NCB: tl.constexpr,
    HAS_PREV: tl.constexpr,
    PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    """One part of one chunk, its winners placed after those of the chunks and parts before
    (a program a part: the placement, most of a pass's time, spreads over PARTS times the
    programs)."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    pid_c = pid // PARTS
    part = pid % PARTS
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    mask_r = rows < N
    rows = rows.to(tl.int64)
    mine = tl.load(taken_ptr + rows * stride_tn + pid_c, mask=mask_r, other=0)
    if tl.max(mine) > 0:  # chunks past a compacted row's end place nothing
        PART: tl.constexpr = CHUNK // PARTS
        pcols = pid_c * CHUNK + part * PART + tl.arange(0, PART)
        base = meta_ptr + rows * stride_mn + (pid_c * PARTS + part) * 4
        thr = tl.load(base, mask=mask_r, other=0).to(tl.uint32, bitcast=True)
        room = tl.load(base + 1, mask=mask_r, other=0)
        n_above = tl.load(base + 2, mask=mask_r, other=0)
        n_ties = tl.load(base + 3, mask=mask_r, other=0)
        start = _counts_before(taken_ptr, rows, mask_r, pid_c, stride_tn, NCB)
        lim = _row_limit(prev_ptr, rows, mask_r, NUM_PREV, M, stride_pn, ROWS, NCB, HAS_PREV)
        req = _row_requests(row_req_ptr, rows, mask_r, stride_rr, TO_SLOTS, HAS_ROW_REQ)
        pkey = _chunk_keys(vals_ptr, rows, mask_r, pcols, lim[:, None], stride_vn, stride_vm)
        _place_part(pkey, pcols, rows, mask_r, thr, room, n_above, n_ties, start, req,
                    idx_ptr, out_v_ptr, out_i_ptr, bt_ptr, stride_in, stride_im, stride_ovn,
                    stride_ovk, stride_oin, stride_oik, stride_btn, stride_btp, ROWS, PART,
                    PAGE_SIZE, HAS_INDEX, TO_SLOTS, PAD)


@triton.jit
def _search_fitting(vals_ptr, meta_ptr, taken_ptr, rows, mask_r, lim, num_chunks, stride_vn,
                    stride_vm, stride_mn, stride_tn, K: tl.constexpr, W: tl.constexpr,
                    CHUNK: tl.constexpr, ROWS: tl.constexpr, PARTS: tl.constexpr,
                    SECANT: tl.constexpr):
    """A row held whole in ``W`` registers (W <= CHUNK, whole parts): its threshold, the
    first chunk's meta (parts past W hold only the padding, key 0) and its count, K; the
    other chunks place nothing."""
    PART: tl.constexpr = CHUNK // PARTS
    WP: tl.constexpr = W // PART  # the parts the registers span
    ukey = _chunk_keys(vals_ptr, rows, mask_r, tl.arange(0, W), lim[:, None], stride_vn,
                       stride_vm)
    thr, room = _threshold(ukey, K, ROWS, SECANT)
    parts = tl.reshape(ukey, (ROWS, WP, PART))
    above = tl.sum((parts > thr[:, None, None]).to(tl.int32), 2)  # (ROWS, WP)
    ties = tl.sum((parts == thr[:, None, None]).to(tl.int32), 2)
    offs_p = tl.arange(0, PARTS)
    held = offs_p[:, None] == tl.arange(0, WP)[None, :]  # (PARTS, WP): part p is held part j
    above = tl.sum(tl.where(held[None, :, :], above[:, None, :], 0), 2)  # (ROWS, PARTS)
    pad = tl.where(thr == 0, PART, 0)  # a part past W: all key 0, ties of a zero threshold
    ties = tl.where(offs_p[None, :] < WP, tl.sum(tl.where(held[None, :, :], ties[:, None, :],
                                                          0), 2), pad[:, None])
    _store_meta(meta_ptr, rows, mask_r, stride_mn, 0, thr, room, above, ties, ROWS, PARTS)
    zero = tl.zeros((ROWS,), tl.int32)
    tl.store(taken_ptr + rows * stride_tn, zero + K, mask=mask_r)
    for c in range(1, num_chunks):
        tl.store(taken_ptr + rows * stride_tn + c, zero, mask=mask_r)


@triton.jit(do_not_specialize=LAST_INTS)
def _topk_last_search_kernel(
    vals_ptr, meta_ptr, taken_ptr, prev_ptr,
    N, M, NUM_PREV,
    stride_vn, stride_vm, stride_mn, stride_tn, stride_pn,
    K: tl.constexpr,
    CHUNK: tl.constexpr,
    FIRST: tl.constexpr,  # <= CHUNK: the register width tried first
    ROWS: tl.constexpr,
    PARTS: tl.constexpr,
    SECANT: tl.constexpr,
    NCB: tl.constexpr,
    PDL: tl.constexpr,
):
    """The last pass after a floor: one program a row over the whole compacted row, which
    the floor leaves short (about 1.4 k on iid scores), in ``FIRST`` registers when it fits
    them (each search round then compares half as many keys as in a chunk's 8K), else its
    first ``CHUNK`` columns as a chunk's search holds them. A row longer than that (scores the
    floor barely cut: many ties, clustered values) is searched exactly by bisection over its
    chunks, read again each round. Meta and counts as the search's for ``cdiv(M, CHUNK)``
    chunks that share one threshold (each chunk's room: the ties left after the chunks
    before), so the place kernel places them as any last pass."""
    pdl_enter(PDL)
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    mask_r = rows < N
    rows = rows.to(tl.int64)
    lim = _counts_before(prev_ptr, rows, mask_r, NUM_PREV, stride_pn, NCB)
    PART: tl.constexpr = CHUNK // PARTS
    zero = tl.zeros((ROWS,), tl.int32)
    num_chunks = tl.cdiv(M, CHUNK)
    if tl.max(lim) <= FIRST:
        _search_fitting(vals_ptr, meta_ptr, taken_ptr, rows, mask_r, lim, num_chunks, stride_vn,
                        stride_vm, stride_mn, stride_tn, K, FIRST, CHUNK, ROWS, PARTS, SECANT)
    elif tl.max(lim) <= CHUNK:  # (never, when FIRST is CHUNK)
        _search_fitting(vals_ptr, meta_ptr, taken_ptr, rows, mask_r, lim, num_chunks, stride_vn,
                        stride_vm, stride_mn, stride_tn, K, CHUNK, CHUNK, ROWS, PARTS, SECANT)
    else:
        thr = tl.zeros((ROWS,), tl.uint32)  # the K-th largest key, a bit a round
        for r in range(32):
            cand = thr | (tl.full((ROWS,), 1, tl.uint32) << (31 - r))
            count = zero
            for c in range(num_chunks):
                key = _chunk_keys(vals_ptr, rows, mask_r, c * CHUNK + tl.arange(0, CHUNK),
                                  lim[:, None], stride_vn, stride_vm)
                count += tl.sum((key >= cand[:, None]).to(tl.int32), 1)
            thr = tl.where(count >= K, cand, thr)
        room = zero + K  # the ties still to take: K less everything above the threshold
        for c in range(num_chunks):
            key = _chunk_keys(vals_ptr, rows, mask_r, c * CHUNK + tl.arange(0, CHUNK),
                              lim[:, None], stride_vn, stride_vm)
            room -= tl.sum((key > thr[:, None]).to(tl.int32), 1)
        for c in range(num_chunks):
            key = _chunk_keys(vals_ptr, rows, mask_r, c * CHUNK + tl.arange(0, CHUNK),
                              lim[:, None], stride_vn, stride_vm)
            parts = tl.reshape(key, (ROWS, PARTS, PART))
            above = tl.sum((parts > thr[:, None, None]).to(tl.int32), 2)
            ties = tl.sum((parts == thr[:, None, None]).to(tl.int32), 2)
            _store_meta(meta_ptr, rows, mask_r, stride_mn, c * PARTS, thr, room, above, ties,
                        ROWS, PARTS)
            took = tl.minimum(tl.sum(ties, 1), room)
            tl.store(taken_ptr + rows * stride_tn + c, tl.sum(above, 1) + took, mask=mask_r)
            room -= took
