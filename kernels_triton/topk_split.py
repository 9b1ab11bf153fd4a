"""``topk_rows``' passes: each is two launches, a search of every chunk's threshold, then a
program per column part placing that part's winners; the last pass after a floor is one
(``_topk_last_kernel``: each part's program searches its row itself, then places its part).

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
LAST_INTS = ["N", "M", "NUM_PREV", "stride_btn", "stride_pn"]


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
def _fitting(vals_ptr, rows, mask_r, lim, g0, stride_vn, stride_vm, K: tl.constexpr,
             W: tl.constexpr, ROWS: tl.constexpr, SECANT: tl.constexpr):
    """A row held whole in ``W`` registers: its threshold, the ties to take, and the entries
    above and at the threshold in the columns before ``g0`` (< W: a part that runs holds
    some of the row's entries or of the first k columns, and W >= k)."""
    cols = tl.arange(0, W)
    ukey = _chunk_keys(vals_ptr, rows, mask_r, cols, lim[:, None], stride_vn, stride_vm)
    thr, room = _threshold(ukey, K, ROWS, SECANT)
    before = cols[None, :] < g0
    above = tl.sum(((ukey > thr[:, None]) & before).to(tl.int32), 1)
    ties = tl.sum(((ukey == thr[:, None]) & before).to(tl.int32), 1)
    return thr, room, above, ties


@triton.jit
def _exact(vals_ptr, rows, mask_r, lim, g0, num_chunks, stride_vn, stride_vm,
           K: tl.constexpr, CHUNK: tl.constexpr, ROWS: tl.constexpr):
    """``_fitting`` for a row longer than a chunk (scores the floor barely cut: many ties,
    clustered values): the K-th largest key by bisection, a bit a round, over its chunks read
    again each round, then the counts."""
    zero = tl.zeros((ROWS,), tl.int32)
    thr = tl.zeros((ROWS,), tl.uint32)
    for r in range(32):
        cand = thr | (tl.full((ROWS,), 1, tl.uint32) << (31 - r))
        count = zero
        for c in range(num_chunks):
            key = _chunk_keys(vals_ptr, rows, mask_r, c * CHUNK + tl.arange(0, CHUNK),
                              lim[:, None], stride_vn, stride_vm)
            count += tl.sum((key >= cand[:, None]).to(tl.int32), 1)
        thr = tl.where(count >= K, cand, thr)
    room = zero + K  # the ties to take: K less everything above the threshold
    above = zero
    ties = zero
    for c in range(num_chunks):
        cols = c * CHUNK + tl.arange(0, CHUNK)
        key = _chunk_keys(vals_ptr, rows, mask_r, cols, lim[:, None], stride_vn, stride_vm)
        before = cols[None, :] < g0
        room -= tl.sum((key > thr[:, None]).to(tl.int32), 1)
        above += tl.sum(((key > thr[:, None]) & before).to(tl.int32), 1)
        ties += tl.sum(((key == thr[:, None]) & before).to(tl.int32), 1)
    return thr, room, above, ties


@triton.jit(do_not_specialize=LAST_INTS)
def _topk_last_kernel(
    vals_ptr, idx_ptr, out_v_ptr, out_i_ptr, bt_ptr, row_req_ptr,
    prev_ptr,  # the floored pass's taken: each row's compacted length
    N, M, NUM_PREV,
    stride_vn, stride_vm,
    stride_in, stride_im,
    stride_ovn, stride_ovk,
    stride_oin, stride_oik,
    stride_btn, stride_btp,
    stride_rr,
    stride_pn,
    K: tl.constexpr,
    CHUNK: tl.constexpr,
    FIRST: tl.constexpr,  # <= CHUNK: the register width tried first
    ROWS: tl.constexpr,
    PARTS: tl.constexpr,
    SECANT: tl.constexpr,
    NCB: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    TO_SLOTS: tl.constexpr,
    HAS_ROW_REQ: tl.constexpr,
    PDL: tl.constexpr,
):
    """The last pass after a floor, in one launch: a program a column part (``CHUNK //
    PARTS`` columns) of the compacted rows. Each finds its rows' threshold itself, the same
    search in every program of a row (the floor leaves a row short, about 1.4 k on iid
    scores: in ``FIRST`` registers when it fits them, else in a chunk's, else exactly over
    its chunks), counts the entries above and at it before its part, and places its part's
    winners at their rank in column order. Parts past a row's end (and past k, where a short
    row is padded) exit at once. One launch instead of a search program a row and then the
    placement's: the part's keys load beside the row's, and no meta goes through memory."""
    pdl_enter(PDL)
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    mask_r = rows < N
    rows = rows.to(tl.int64)
    lim = _counts_before(prev_ptr, rows, mask_r, NUM_PREV, stride_pn, NCB)
    PART: tl.constexpr = CHUNK // PARTS
    g0 = tl.program_id(0) * PART  # the part's first column
    if g0 < tl.max(tl.where(mask_r, tl.maximum(lim, K), 0)):
        pcols = g0 + tl.arange(0, PART)
        pkey = _chunk_keys(vals_ptr, rows, mask_r, pcols, lim[:, None], stride_vn, stride_vm)
        req = _row_requests(row_req_ptr, rows, mask_r, stride_rr, TO_SLOTS, HAS_ROW_REQ)
        if tl.max(lim) <= FIRST:
            thr, room, above, ties = _fitting(vals_ptr, rows, mask_r, lim, g0, stride_vn,
                                              stride_vm, K, FIRST, ROWS, SECANT)
        elif tl.max(lim) <= CHUNK:  # (never, when FIRST is CHUNK)
            thr, room, above, ties = _fitting(vals_ptr, rows, mask_r, lim, g0, stride_vn,
                                              stride_vm, K, CHUNK, ROWS, SECANT)
        else:
            thr, room, above, ties = _exact(vals_ptr, rows, mask_r, lim, g0, tl.cdiv(M, CHUNK),
                                            stride_vn, stride_vm, K, CHUNK, ROWS)
        _place_part(pkey, pcols, rows, mask_r, thr, room, above, ties,
                    tl.zeros((ROWS,), tl.int32), req, idx_ptr, out_v_ptr, out_i_ptr, bt_ptr,
                    stride_in, stride_im, stride_ovn, stride_ovk, stride_oin, stride_oik,
                    stride_btn, stride_btp, ROWS, PART, PAGE_SIZE, HAS_INDEX, TO_SLOTS, True)
