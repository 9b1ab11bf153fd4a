"""Row-wise top-k of scores, with the indices (or KV slots) of the winners.

``topk_rows(values (N, M) fp32, k)`` keeps the ``k`` largest entries of every row and returns
``(values (N, k) fp32, index (N, k) int32)``: ``index`` is the column of each winner (or the
``index`` tensor's entry there, when one is given), -1 with value ``-inf`` where a row has fewer
than ``k`` finite entries. ``-inf`` marks an entry that must not be chosen (a token the row
does not see). Winners are not sorted; equal values are taken in column order.

Chunked selection: a program takes ``CHUNK`` (>= 2k) entries of ``ROWS`` rows (one on a GPU)
and keeps each row's k largest, so a pass shrinks a row of M entries to ceil(M / CHUNK) · k
candidates; passes repeat until one chunk remains (128K scores, k = 2048, CHUNK = 8192:
128K -> 32K -> 8K -> 2K). Inside a program each row's k-th largest value is found exactly over
the order-preserving integer image of the fp32 values (a chunk with at most k finite entries,
as a short request's columns past its history are, skips the search: all of them win), by one
of two searches, each round one compare and one sum over the chunk:
- false position on the values (``config["SECANT"]``, the default; ``_kth_largest_secant``):
  the candidate interpolates where the count crosses k between the bracket's ends (Illinois),
  for 16 rounds, then the rows left (ties) bisect their bracket, 33 rounds at most. 8-10
  rounds on the indexer's scores (``benchmarks/topk_rounds.py``); 174 instructions a round
  (offline sm_90, 8K chunk, 8 warps, 210 registers).
- bisection on the keys (``_kth_largest``): a round per bit from the top, keeping the bit while
  at least k keys reach the candidate, until exactly k do or the 32 bits are spent; 19-23
  rounds on those scores, 129 instructions a round.
On an H200 (``dsa_sweep.py --only topk``, the DSA pipeline's scores, 16 rows) false position
takes 0.0351 / 0.0604 ms at 32K / 128K against the bisection's 0.0370 / 0.0678
(``dsa_topk.json``). Its first GPU form lost the width history it bisects by (a Triton while
loop drops a carried name whose value enters the loop as another carried name's) and crawled
through denormals on a row crossing zero; the fixed round budget needs no history.
The winners are then compacted with one prefix sum (counts of the entries above the threshold and
of the ties packed in one int32), ``PARTS`` column parts (at most 16K entries each) one after
another. With one part (the GPU default) the keys still in registers place the winners and give
back their values (the order key inverts exactly): H200, DSA pipeline scores, 0.0350 / 0.0605
-> 0.0322 / 0.0580 ms at 32K / 128K against reading the values again; with more parts each
part's values are read again, so only the keys stay in registers through the rounds (offline
sm_90, Triton 3.6, 8K chunk, 8 warps: 215 registers with one part, 111 / 117 with four, two
programs an SM; the last pass, with the block table, 255). Two parts: 0.0326 / 0.0594.

Tried on an H200 (16 rows, k = 2048, graph-timed), against 0.032 / 0.061 ms at 32K / 128K now:
- a radix select in each program instead of the bisection (rounds of 16- or 256-bin
  ``tl.histogram`` counts, or counts with atomics in scratch, then the digit where the count
  from the top reaches what is left), with two scans for the winners: 0.047 / 0.091 ms at best
  (4-bit digits, 16 warps), 0.038 / 0.074 with the one scan (removed);
- an exact threshold in five launches whatever the row length (three levels of 2,048-bin
  counts, each chunk adding its ``tl.histogram`` to the row's table with atomics, then a count
  and a write of the winners in column order): 0.069 / 0.19 ms at best, slower;
- rows split into pieces of 2-8K, one launch per radix round in which every piece adds its 256-
  or 16-bin counts to its row's with integer atomics, then one launch placing each piece's
  winners after those of the pieces before it: 0.033 / 0.073 ms at best (8-bit digits, 16
  warps), slower from 64 rows up, and with 8-bit digits on 4 or 8 warps the later rounds'
  counts came out short (wrong winners; round 0 exact; not understood, Triton 3.6). Dropped:
  too little gain for a wrong-result mode (benchmarks/results/h200/topk_split_tried.json).

``block_table`` (B, W) with ``row_req`` (N,) (request of each row; None: row n is request n)
turns the final winners' columns, token positions in the row's paged history, into KV slots
``page * PS + offset`` (``page_size`` PS): the input of ``mla_sparse``.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from splash.kernels_triton import _validate as V

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
    """Order keys as int32 in the same order: the search reduces and clamps signed ints (with
    unsigned ones its threshold came out wrong on an H200, Triton 3.6, where the interpreter
    was right)."""
    return ukey.to(tl.int32, bitcast=True) ^ _KEY_MIN


@triton.jit
def _value(skey):
    """The fp32 value of a signed order key (``_signed``) of a finite value."""
    return tl.where(skey >= 0, skey, skey ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _kth_largest_secant(ukey, K: tl.constexpr, ROWS: tl.constexpr, ROUNDS: tl.constexpr = 16):
    """``_kth_largest`` by false position on the values: the candidate interpolates between a
    bracket's ends (count at ``lo`` >= K, above ``hi`` < K) where the count crosses K, the
    Illinois rule halving a stuck end's weight. After ``ROUNDS`` rounds the rows not done (ties,
    odd shapes) bisect their bracket's keys, at most 32 rounds more. Same result as the
    bisection, in fewer rounds on smooth scores (benchmarks/topk_rounds.py, a numpy model of
    both loops, 8K-entry chunks, k = 2,048): 8-10 rounds against 19-23 on scores shaped like
    the indexer's. The bracket is kept as signed keys (int32)."""
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
    while (r < ROUNDS + 40) & (tl.sum((~done).to(tl.int32)) > 0):  # 33 rounds always suffice
        cand = (lo.to(tl.int64) + (hi.to(tl.int64) - lo + 1) // 2).to(tl.int32)  # in (lo, hi]
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


# ints that vary by step: one binary for all (tests check the warm-up against them)
SHAPE_INTS = ["N", "stride_btn"]


@triton.jit(do_not_specialize=SHAPE_INTS)
def _topk_chunk_kernel(
    vals_ptr,  # (N, M) fp32
    idx_ptr,  # (N, M) int32 (HAS_INDEX)
    out_v_ptr,  # (N, num_chunks * K) fp32
    out_i_ptr,  # (N, num_chunks * K) int32
    bt_ptr,  # (B, W) int (TO_SLOTS)
    row_req_ptr,  # (N,) int (TO_SLOTS and HAS_ROW_REQ)
    N,
    M,
    stride_vn, stride_vm,
    stride_in, stride_im,
    stride_ovn, stride_ovk,
    stride_oin, stride_oik,
    stride_btn, stride_btp,
    stride_rr,
    K: tl.constexpr,
    CHUNK: tl.constexpr,
    ROWS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    TO_SLOTS: tl.constexpr,
    HAS_ROW_REQ: tl.constexpr,
    PARTS: tl.constexpr,  # the winners are placed in PARTS column parts, one after another
    SECANT: tl.constexpr = False,  # the k-th largest by _kth_largest_secant
):
    pid_c = tl.program_id(0)
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    mask_r = rows < N
    rows = rows.to(tl.int64)
    cols = pid_c * CHUNK + tl.arange(0, CHUNK)  # (CHUNK,)
    inside = mask_r[:, None] & (cols < M)[None, :]  # (ROWS, CHUNK)
    # the keys live through the rounds alone; the winners are then placed a part at a time
    ukey = _order_key(tl.load(vals_ptr + rows[:, None] * stride_vn + cols[None, :] * stride_vm,
                              mask=inside, other=float("-inf")))
    if SECANT:
        thr = _kth_largest_secant(ukey, K, ROWS)  # (ROWS,)
    else:
        thr = _kth_largest(ukey, K, ROWS)
    room = K - tl.sum((ukey > thr[:, None]).to(tl.int32), 1)  # ties to take, in column order
    if TO_SLOTS:
        if HAS_ROW_REQ:
            req = tl.load(row_req_ptr + rows * stride_rr, mask=mask_r, other=0).to(tl.int64)
        else:
            req = rows
    PART: tl.constexpr = CHUNK // PARTS
    n_above = tl.zeros((ROWS,), tl.int32)  # winners above the threshold in the parts before
    n_ties = tl.zeros((ROWS,), tl.int32)
    for part in tl.static_range(PARTS):
        pcols = pid_c * CHUNK + part * PART + tl.arange(0, PART)
        p_in = mask_r[:, None] & (pcols < M)[None, :]
        if PARTS == 1:
            pkey = ukey  # still in registers
        else:
            pkey = _order_key(tl.load(vals_ptr + rows[:, None] * stride_vn
                                      + pcols[None, :] * stride_vm, mask=p_in, other=float("-inf")))
        above = pkey > thr[:, None]
        ties = pkey == thr[:, None]
        # one scan counts both, entries above (low 16 bits) and ties (high): PART <= 16K
        counts = tl.cumsum(above.to(tl.int32) + (ties.to(tl.int32) << 16), 1)
        above_rank = (counts & 0xFFFF) + n_above[:, None]
        tie_rank = (counts >> 16) + n_ties[:, None]
        n_above += tl.sum(above.to(tl.int32), 1)
        n_ties += tl.sum(ties.to(tl.int32), 1)
        take = above | (ties & (tie_rank <= room[:, None]))  # the first `room` ties
        dst = above_rank + tl.minimum(tie_rank, room[:, None]) - 1  # in column order
        chosen = pkey > 0
        store = take & mask_r[:, None]
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
        out_col = pid_c * K + dst
        v = tl.where(chosen, _value(_signed(pkey)), float("-inf"))  # the key's value back
        tl.store(out_v_ptr + rows[:, None] * stride_ovn + out_col * stride_ovk, v, mask=store)
        tl.store(out_i_ptr + rows[:, None] * stride_oin + out_col * stride_oik,
                 idx.to(tl.int32), mask=store)


# ---------------------------------------------------------------------------------------------
# launcher

# ROWS: rows per program (the interpreter pays per program, a GPU per register)
# GPU (H200, 16 rows, k = 2,048, graph-timed; benchmarks/results/h200/topk_select.json): 8
# warps on 8K chunks, 0.034 / 0.050 ms at 32K / 64K, against 0.035 / 0.052 on 16 warps (32
# warps and 4K chunks were slower). On that benchmark's scores 16K chunks in 4 parts won at
# 128K (0.057 vs 0.065 ms, two passes instead of three) and 8K chunks in 2 parts at 256K (0.098
# vs 0.107), but in the DSA pipeline (kernel_bench.py --only-dsa, the indexer's own scores) the
# 128K pick lost (0.0675 -> 0.0716 ms at 16 heads): the bisection's rounds depend on the
# values, so chunks stay fixed. A program's cost is its instruction count: 8K entries on one
# SM. ncu at 16 x 128K: the three passes 29.6 / 17.1 / 20.1 us, stalls on fixed-latency
# dependencies and shared memory, 230-255 registers (12.7% occupancy; 4 parts: 111-117, two
# programs an SM).
_GPU_DEFAULTS: dict[str, Any] = {"CHUNK": 8192, "ROWS": 1, "num_warps": 8, "PARTS": 1,
                                 "SECANT": True}
_CPU_DEFAULTS: dict[str, Any] = {"CHUNK": 256, "ROWS": 32, "num_warps": 4, "PARTS": 2,
                                 "SECANT": True}


def topk_config(device: torch.device, k: int, config: dict | None) -> dict[str, Any]:
    cfg = dict(_GPU_DEFAULTS if device.type == "cuda" else _CPU_DEFAULTS)
    unknown = sorted(set(config or {}) - set(cfg))
    if unknown:
        raise ValueError(f"topk_rows config: unknown keys {unknown}; known: {sorted(cfg)}")
    cfg.update(config or {})
    for key, low in (("CHUNK", 16), ("ROWS", 1), ("PARTS", 1)):
        value = cfg[key]
        if not isinstance(value, int) or value < low or value & (value - 1):
            raise ValueError(f"config {key}={value!r} must be a power of two >= {low}")
    chunk = cfg["CHUNK"]
    cfg["CHUNK"] = max(chunk, V.next_pow2(2 * k))  # each pass must at least halve a row
    # parts of at most 16K columns (the packed scan's 16-bit counts), at most one a column
    cfg["PARTS"] = min(max(cfg["PARTS"], cfg["CHUNK"] // 16384), cfg["CHUNK"])
    return cfg


def topk_rows(
    values: torch.Tensor,
    k: int,
    index: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    row_req: torch.Tensor | None = None,
    page_size: int = 1,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest finite entries of each row of ``values`` (N, M) fp32 ->
    ``(values (N, k) fp32, index (N, k) int32)``; see the module docstring for ``index``,
    ``block_table``, ``row_req`` and ``page_size``."""
    v = V.check_tensor("values", values, 2, (torch.float32,))
    dev = v.device
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k={k!r} must be an int >= 1")
    N, M = v.shape
    if index is not None:
        V.check_tensor("index", index, 2, (torch.int32,), dev)
        if tuple(index.shape) != (N, M):
            raise ValueError(f"index has shape {tuple(index.shape)}; expected {(N, M)}")
    if block_table is not None:
        V.check_tensor("block_table", block_table, 2, V.INDEX_DTYPES, dev)
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size={page_size!r} must be an int >= 1")
        if row_req is None:
            V.check_dim("block_table", block_table, 0, N, "one row per row of values")
        else:
            V.check_tensor("row_req", row_req, 1, V.INDEX_DTYPES, dev)
            V.check_dim("row_req", row_req, 0, N, "one request per row of values")
            V.check_index_range("row_req", row_req, block_table.shape[0], allow_neg1=False)
    elif row_req is not None:
        raise ValueError("row_req needs a block_table")
    cfg = topk_config(dev, k, config)
    chunk = cfg["CHUNK"]
    idx = index
    while True:
        num_chunks = max(triton.cdiv(M, chunk), 1)
        last = num_chunks == 1
        out_v = torch.empty((N, num_chunks * k), dtype=torch.float32, device=dev)
        out_i = torch.empty((N, num_chunks * k), dtype=torch.int32, device=dev)
        if N:
            idx_arg = idx if idx is not None else out_i  # never read without HAS_INDEX
            to_slots = block_table is not None and last
            bt = block_table if block_table is not None and last else out_i
            rr = row_req if to_slots and row_req is not None else out_i
            rows = min(cfg["ROWS"], V.next_pow2(N, 1))
            grid = (num_chunks, triton.cdiv(N, rows))
            _topk_chunk_kernel[grid](
                v, idx_arg, out_v, out_i, bt, rr, N, M,
                *v.stride(), *idx_arg.stride(), *out_v.stride(), *out_i.stride(),
                *bt.stride(), rr.stride(0),
                K=k, CHUNK=chunk, ROWS=rows, PAGE_SIZE=page_size, HAS_INDEX=idx is not None, TO_SLOTS=to_slots,
                HAS_ROW_REQ=row_req is not None, PARTS=cfg["PARTS"], SECANT=bool(cfg["SECANT"]),
                num_warps=cfg["num_warps"],
            )
        if last:
            return out_v, out_i
        v, idx, M = out_v, out_i, num_chunks * k


# ---------------------------------------------------------------------------------------------
# reference


def topk_rows_ref(
    values: torch.Tensor,
    k: int,
    index: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    row_req: torch.Tensor | None = None,
    page_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of ``topk_rows``, sorted by value (compare as sets): torch.topk over the
    row, -1 / -inf where fewer than ``k`` entries are finite."""
    N, M = values.shape
    padded = torch.cat((values, values.new_full((N, max(k - M, 0)), float("-inf"))), dim=1)
    top_v, top_c = padded.topk(k, dim=1)
    chosen = torch.isfinite(top_v)
    if index is not None:
        idx = torch.gather(index.long(), 1, top_c.clamp(max=M - 1))
    else:
        idx = top_c.long()
    if block_table is not None:
        req = row_req.long() if row_req is not None else torch.arange(N, device=values.device)
        page = block_table.long()[req[:, None], (idx.clamp(min=0) // page_size)]
        idx = page * page_size + idx % page_size
    idx = torch.where(chosen, idx, -1)
    return top_v.masked_fill(~chosen, float("-inf")), idx.to(torch.int32)
