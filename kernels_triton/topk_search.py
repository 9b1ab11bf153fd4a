"""The per-chunk pieces of ``topk_rows``' kernels: fp32 scores' order keys, the two exact
searches of a chunk's k-th largest key (bisection on the keys; false position on the values),
and the placement of a column part's winners after those of the parts before it."""

from __future__ import annotations

import triton
import triton.language as tl

_KEY_MIN = tl.constexpr(-2147483648)  # below every finite value's key (and -inf's): "never chosen"


@triton.jit
def _order_key(v):
    """fp32 -> uint32 in the floats' order; -inf (a masked entry: never chosen) -> 0, below
    every finite value's image."""
    bits = v.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # signed order = float order
    key = tl.where(v > float("-inf"), key, _KEY_MIN)
    return (key ^ _KEY_MIN).to(tl.uint32, bitcast=True)


@triton.jit
def _kth_largest(ukey, K: tl.constexpr, ROWS: tl.constexpr):
    """Each row's K-th largest of ``ukey`` (ROWS, CHUNK) uint32 (``_order_key``), exactly, by
    bisection: a bit stays set while at least K keys reach the candidate; a row is done once
    exactly K do (its K-th largest is then the least of them), else after 32 bits. A row with
    at most K chosen keys (key 0 marks the rest: a short request's columns past its history)
    is done at once: all of them win."""
    prefix = tl.zeros((ROWS,), tl.uint32)
    done = tl.sum((ukey > 0).to(tl.int32), 1) <= K
    r = 0
    while (r < 32) & (tl.sum((~done).to(tl.int32)) > 0):
        cand = prefix | (tl.full((ROWS,), 1, tl.uint32) << (31 - r))
        count = tl.sum((ukey >= cand[:, None]).to(tl.int32), 1)
        keep = (count >= K) & ~done
        prefix = tl.where(keep, cand, prefix)
        done = done | (keep & (count == K))
        r += 1
    top = tl.where(ukey >= prefix[:, None], ukey, tl.full(ukey.shape, 0xFFFFFFFF, tl.uint32))
    return tl.min(top, 1)


@triton.jit
def _signed(ukey):
    """Order keys as int32 in the same order: the false-position bracket, whose ends are
    clamped and stepped by one, lives in signed ints."""
    return ukey.to(tl.int32, bitcast=True) ^ _KEY_MIN


@triton.jit
def _value(skey):
    """The fp32 value of a signed order key (``_signed``) of a finite value."""
    return tl.where(skey >= 0, skey, skey ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _kth_largest_secant(ukey, K: tl.constexpr, ROWS: tl.constexpr, ROUNDS: tl.constexpr = 16,
                        BISECT: tl.constexpr = True):
    """``_kth_largest`` by false position on the values: the candidate interpolates between a
    bracket's ends (count at ``lo`` >= K, above ``hi`` < K) where the count crosses K, the
    Illinois rule halving a stuck end's weight. After ``ROUNDS`` rounds the rows not done (ties,
    odd shapes) bisect their bracket's keys, at most 33 rounds more. Same result as the
    bisection, in fewer rounds on smooth scores (benchmarks/topk_rounds.py, a numpy model of
    both loops, 8K-entry chunks, k = 2,048): 8-10 rounds against 19-23 on scores shaped like
    the indexer's. The bracket is kept as signed keys (int32). Without ``BISECT`` the search
    stops after ``ROUNDS`` rounds and returns the least key at or above the bracket's low end:
    at least K keys reach it (a lower bound of the K-th largest, exact when the rounds found
    it)."""
    chosen = ukey > 0
    n = tl.sum(chosen.to(tl.int32), 1)
    done = n <= K
    never = tl.full(ukey.shape, 0xFFFFFFFF, tl.uint32)  # signed: the largest key
    lo = tl.where(done, _KEY_MIN, tl.min(_signed(tl.where(chosen, ukey, never)), 1))
    hi = tl.max(_signed(ukey), 1)  # the answer lies in [lo, hi]
    f_lo = (n - K).to(tl.float32)  # the count at lo, less K (> 0 while searching)
    f_hi = tl.full((ROWS,), -K, tl.float32)  # the count above hi, less K (< 0)
    side = tl.zeros((ROWS,), tl.int32)  # the end the last round moved: 1 lo, -1 hi
    done = done | (lo >= hi)
    r = 0
    while (r < ROUNDS) & (tl.sum((~done).to(tl.int32)) > 0):
        frac = f_lo / tl.maximum(f_lo - f_hi, 1.0)  # in [0, 1]: no overflow near fp32's limit
        guess = _signed(_order_key(_value(lo) * (1.0 - frac) + _value(hi) * frac))
        cand = tl.minimum(tl.maximum(guess, lo + 1), hi)
        count = _count_from(ukey, cand)
        up = (count >= K) & ~done
        down = (count < K) & ~done
        lo = tl.where(up, cand, lo)
        hi = tl.where(down, cand - 1, hi)
        f_lo = tl.where(up, (count - K).to(tl.float32),
                        tl.where(down & (side < 0), f_lo * 0.5, f_lo))
        f_hi = tl.where(down, (count - K).to(tl.float32),
                        tl.where(up & (side > 0), f_hi * 0.5, f_hi))
        side = tl.where(up, 1, tl.where(down, -1, side))
        done = done | (up & (count == K)) | (lo >= hi)
        r += 1
    if BISECT:
        while (r < ROUNDS + 40) & (tl.sum((~done).to(tl.int32)) > 0):  # 33 rounds suffice
            cand = (lo.to(tl.int64) + (hi.to(tl.int64) - lo + 1) // 2).to(tl.int32)  # (lo, hi]
            count = _count_from(ukey, cand)
            up = (count >= K) & ~done
            lo = tl.where(up, cand, lo)
            hi = tl.where((count < K) & ~done, cand - 1, hi)
            done = done | (up & (count == K)) | (lo >= hi)
            r += 1
    lo_u = (lo ^ _KEY_MIN).to(tl.uint32, bitcast=True)
    thr = tl.min(_signed(tl.where(ukey >= lo_u[:, None], ukey, never)), 1)
    return (thr ^ _KEY_MIN).to(tl.uint32, bitcast=True)


@triton.jit
def _count_from(ukey, cand):
    """Per row, how many of ``ukey`` (ROWS, CHUNK) reach the signed key ``cand`` (ROWS,)."""
    cand_u = (cand ^ _KEY_MIN).to(tl.uint32, bitcast=True)
    return tl.sum((ukey >= cand_u[:, None]).to(tl.int32), 1)


@triton.jit
def _chunk_keys(vals_ptr, rows, mask_r, cols, lim, stride_vn, stride_vm):
    """Order keys (``_order_key``) of rows x cols of the values; -inf (key 0) outside, and at
    columns from ``lim`` on (an int, or (ROWS, 1): each row's valid columns)."""
    inside = mask_r[:, None] & (cols[None, :] < lim)
    return _order_key(tl.load(vals_ptr + rows[:, None] * stride_vn + cols[None, :] * stride_vm,
                              mask=inside, other=float("-inf")))


@triton.jit
def _threshold(ukey, K: tl.constexpr, ROWS: tl.constexpr, SECANT: tl.constexpr):
    """Each row's k-th largest key, and the ties at it to take (in column order)."""
    if SECANT:
        thr = _kth_largest_secant(ukey, K, ROWS)  # (ROWS,)
    else:
        thr = _kth_largest(ukey, K, ROWS)
    return thr, K - tl.sum((ukey > thr[:, None]).to(tl.int32), 1)


@triton.jit
def _place_part(pkey, pcols, rows, mask_r, thr, room, n_above, n_ties, out_base, req,
                idx_ptr, out_v_ptr, out_i_ptr, bt_ptr, stride_in, stride_im, stride_ovn,
                stride_ovk, stride_oin, stride_oik, stride_btn, stride_btp,
                ROWS: tl.constexpr, PART: tl.constexpr, PAGE_SIZE: tl.constexpr,
                HAS_INDEX: tl.constexpr, TO_SLOTS: tl.constexpr, PAD: tl.constexpr):
    """Store a part's winners (keys ``pkey`` (ROWS, PART) at columns ``pcols``) at
    ``out_base`` (ROWS,) + their rank: ``n_above`` / ``n_ties`` entries above / at the
    threshold come before the part. Without ``PAD`` entries never chosen (key 0) are not
    stored even where they tie (a compacting pass: only the last pads a row to k)."""
    above = pkey > thr[:, None]
    ties = pkey == thr[:, None]
    # one scan counts both, entries above (low 16 bits) and ties (high): PART <= 16K
    counts = tl.cumsum(above.to(tl.int32) + (ties.to(tl.int32) << 16), 1)
    above_rank = (counts & 0xFFFF) + n_above[:, None]
    tie_rank = (counts >> 16) + n_ties[:, None]
    take = above | (ties & (tie_rank <= room[:, None]))  # the first `room` ties
    dst = above_rank + tl.minimum(tie_rank, room[:, None]) - 1  # in column order
    chosen = pkey > 0
    store = take & mask_r[:, None]
    if not PAD:
        store = store & chosen
    if HAS_INDEX:
        idx = tl.load(idx_ptr + rows[:, None] * stride_in + pcols[None, :] * stride_im,
                      mask=store & chosen, other=-1)
    else:
        idx = tl.zeros((ROWS, PART), tl.int32) + pcols[None, :]
    idx = tl.where(chosen, idx, -1)
    if TO_SLOTS:
        has_pos = chosen & (idx >= 0)
        pos = tl.where(has_pos, idx, 0)
        page = tl.load(bt_ptr + req[:, None] * stride_btn + (pos // PAGE_SIZE) * stride_btp,
                       mask=store & has_pos, other=0)
        idx = tl.where(has_pos, page * PAGE_SIZE + pos % PAGE_SIZE, -1)
    out_col = out_base[:, None] + dst
    v = tl.where(chosen, _value(_signed(pkey)), float("-inf"))  # the key's value back
    tl.store(out_v_ptr + rows[:, None] * stride_ovn + out_col * stride_ovk, v, mask=store)
    tl.store(out_i_ptr + rows[:, None] * stride_oin + out_col * stride_oik, idx.to(tl.int32),
             mask=store)


@triton.jit
def _row_requests(row_req_ptr, rows, mask_r, stride_rr, TO_SLOTS: tl.constexpr,
                  HAS_ROW_REQ: tl.constexpr):
    """Each row's request (its block-table row) when the winners become slots."""
    req = rows
    if TO_SLOTS and HAS_ROW_REQ:
        req = tl.load(row_req_ptr + rows * stride_rr, mask=mask_r, other=0).to(tl.int64)
    return req


@triton.jit
def _counts_before(ptr, rows, mask_r, n, stride_n, NCB: tl.constexpr):
    """Per row, the sum of the first ``n`` entries of an (N, >= n) int32 table (``n`` <=
    ``NCB``, a power of two): the winners of the chunks before, or a compacted row's length."""
    offs = tl.arange(0, NCB)
    counts = tl.load(ptr + rows[:, None] * stride_n + offs[None, :],
                     mask=mask_r[:, None] & (offs < n)[None, :], other=0)
    return tl.sum(counts, 1)


@triton.jit
def _floor_key(floor_ptr, rows, mask_r, G, stride_fn, K: tl.constexpr, ROWS: tl.constexpr,
               FLOOR_N: tl.constexpr, ROUNDS: tl.constexpr):
    """A lower bound of each row's K-th largest key from ``G`` maxima of disjoint groups of
    its entries: at least K entries reach any value that K group maxima reach. The maxima fold
    to ``FLOOR_N`` (entry i takes those at i, i + FLOOR_N, ...: still disjoint groups), then
    ``ROUNDS`` rounds of false position bound their K-th largest from below. Key 0 (no bound)
    where fewer than K groups hold a finite entry."""
    offs = tl.arange(0, FLOOR_N)
    base = floor_ptr + rows[:, None] * stride_fn
    m = tl.load(base + offs[None, :], mask=mask_r[:, None] & (offs < G)[None, :],
                other=float("-inf"))
    for j in range(FLOOR_N, G, FLOOR_N):
        more = tl.load(base + (j + offs)[None, :], mask=mask_r[:, None] & (j + offs < G)[None, :],
                       other=float("-inf"))
        m = tl.maximum(m, more)
    return _kth_largest_secant(_order_key(m), K, ROWS, ROUNDS, BISECT=False)
