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
A pass is two launches (``topk_split``): ``_topk_search_kernel`` finds each chunk's threshold
and the counts above and at it in each of its ``PARTS`` column parts (only the keys in
registers: offline sm_90, 8K chunk, 8 warps, 92 registers, two programs an SM), then
``_topk_place_kernel`` places each part's winners, a program a part (``place_warps`` warps),
with one prefix sum (counts of the entries above the threshold and of the ties packed in one
int32). The placement (its scans, index and block-table loads, scattered stores) held three
quarters of a pass's samples under ncu when one program did both: split, it spreads over PARTS
times the programs (H200, DSA pipeline scores, 16 x 32K / 128K: 0.0317 / 0.0576 ms fused with
the winners placed from the keys still in registers, 0.0275 / 0.0495 split, eight parts;
``dsa_topk_split.json``). A pass compacts: a chunk's winners follow those of the row's chunks
before it, so the next pass reads each row only as far as they go. With ``floor_max``, the
indexer's group maxima, the first pass drops every entry under a bound of the row's k-th
largest and the next pass, a program a row, is the last (``topk_split``'s docstring): 0.0293 /
0.0533 -> 0.0230 / 0.0344 ms (``dsa_topk_floor.json``). That pass searches a row whose
survivors fit ``config["SURVIVOR_CHUNK"]`` (4K on a GPU) in that many registers, else in a
chunk's, else exactly over its chunks re-read each round: a round then compares half the
keys (16 x 32K / 128K, the DSA pipeline's scores: 0.0215-0.0224 -> 0.0197-0.0202 / 0.0333-
0.0339 -> 0.0314-0.0315 ms, ``dsa_topk_survivors.json``). A narrower chunk alone for that
pass was no choice: survivors past it, as on other scores or a trend along the history, took
the exact fallback (128K: 0.033 -> 0.204 ms). That last pass is one launch
(``_topk_last_kernel``): a program a column part finds its row's threshold itself, the same
search in the few programs a short row has, and places its part; the search's meta no longer
goes through memory to a placement launch (the DSA layer at batch 16: 16 heads 32K 0.0631 ->
0.0612 ms, 128K 0.1325 -> 0.1310, 128 heads 32K 0.0893 -> 0.0868, ``dsa_topk_last.json``).
Its part's indices and block-table pages loaded before the search instead of after, and its
keys with the row lengths instead of after them, were each slower (+0.4 / +1.2%,
``dsa_topk_last_tried.json``).

Tried on an H200 (16 rows, k = 2048, graph-timed), against 0.032 / 0.061 ms at 32K / 128K then:
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
- with the floor, two launches instead of four: a program per chunk keeping its entries at or
  above the floor (or its k largest), compacted into its own k slots, then a program per row
  copying the survivors together, searching them in registers and placing the winners with one
  scan (the placement inside the searching programs, one program a row): 16 x 32K / 128K, the
  DSA layer 0.0724 -> 0.0856 / 0.1428 -> 0.1632 ms (per-kernel timeline, ``dsa_timeline.json``):
  at 32K the per-chunk kernel ended 17 us after the indexer and the per-row pick 19 us after
  it, against 12 and 12 for the search and placement launches each replaced (placing in the
  searching programs, one a row, is what costs).
- around the floor, on its four launches (16 x 32K / 128K, 0.0194 / 0.0326 ms): the floored
  pass in 1-4 parts a chunk instead of 8 (each fewer slower, to 0.0396 at 128K), the fold
  unrolled, the floor found once a row in a launch of its own (0.0200-0.0208 / 0.0324), and
  1-4 warps for the last search or 4 / 16 for the floored pass (1 warp 0.0632 at 128K): none
  faster (``dsa_topk_floor_parts.json``, ``dsa_topk_floor_kernel.json``,
  ``dsa_topk_warps.json``). Under ncu at 128K (``profile_topk_floor/``) the floored search
  takes 15.6 us (46% of the SMs busy), its placement 10.9 us over 2,048 programs, busy on
  every entry of a part though about 1% survive, the last search 8.3 us (one program a row,
  a latency chain) and the last placement 6.7 us. The floored pass on its own 4K chunks
  (twice the programs at 32K) or 16K ones, the last pass on 8K: 16 x 32K 0.0196 -> 0.0197 /
  0.0232 ms, not kept (session 35, the option removed).
- the floored pass placing its own winners, each chunk's at its own k columns (runs: no
  program waits for the counts of the chunks before), part after part in the searching
  program, and the last pass reading the runs (positions mapped through the chunks'
  counts): one launch fewer, outputs bitwise the same, but the DSA layer 4-6% slower (16
  heads 32K 0.0608 -> 0.0643 ms, 128K 0.1299 -> 0.1356): the eight parts placed one after
  another cost more than the launch that places them side by side
  (``dsa_topk_runs_tried.json``).

``block_table`` (B, W) with ``row_req`` (N,) (request of each row; None: row n is request n)
turns the final winners' columns, token positions in the row's paged history, into KV slots
``page * PS + offset`` (``page_size`` PS): the input of ``mla_sparse``.
"""

from __future__ import annotations

from typing import Any

import torch
import triton

from splash.kernels_triton import _validate as V
from splash.kernels_triton.pdl import pdl
from splash.kernels_triton.topk_split import (
    _topk_last_kernel,
    _topk_place_kernel,
    _topk_search_kernel,
)

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
# Split passes (dsa_topk_split.json): the search on 8 warps, eight parts placed on 4; 16K chunks
# won at 128K alone (0.0472 against 0.0495 ms) and lost at 32K (0.0366 against 0.0275).
_GPU_DEFAULTS: dict[str, Any] = {"CHUNK": 8192, "ROWS": 1, "num_warps": 8, "PARTS": 8,
                                 "SECANT": True, "place_warps": 4, "FLOOR_N": 4096,
                                 "FLOOR_ROUNDS": 6, "SURVIVOR_CHUNK": 4096}
# (the floor from 4,096 folded maxima in 6 false-position rounds: 0.0230 / 0.0344 ms at 16 x
# 32K / 128K against 0.0293 / 0.0533 without; 3 rounds 0.0230 / 0.0329, but a looser floor
# (8,192 maxima, 3 rounds) left rows longer than a chunk: 0.261 ms at 128K, the exact
# fallback; dsa_topk_floor.json)
_CPU_DEFAULTS: dict[str, Any] = {"CHUNK": 256, "ROWS": 32, "num_warps": 4, "PARTS": 2,
                                 "SECANT": True, "place_warps": 4, "FLOOR_N": 64,
                                 "FLOOR_ROUNDS": 6, "SURVIVOR_CHUNK": None}
FLOOR_GROUP = 8  # tokens a group maximum of the indexer's covers (``index_scores(group=)``)
_NCB = 64  # chunk counts a split pass sums in registers (one binary up to 64 chunks)


def floor_group(device: torch.device, k: int, width: int, config: dict | None) -> int:
    """The group size ``index_scores`` should take maxima over for ``topk_rows``' floor: a
    selection of ``k`` over ``width`` columns in several split passes, with more groups than
    k (else 0). (At 16 x 32K on an H200 the maxima cost the indexer 0.0015 ms and the floor
    saved top-k as much: 0.0735 ms for the pipeline with it, 0.0739 without.)"""
    cfg = topk_config(device, k, config)
    several = width > cfg["CHUNK"] and cfg["FLOOR_N"] > k
    return FLOOR_GROUP if several and width // FLOOR_GROUP > k else 0


def topk_config(device: torch.device, k: int, config: dict | None) -> dict[str, Any]:
    cfg = dict(_GPU_DEFAULTS if device.type == "cuda" else _CPU_DEFAULTS)
    unknown = sorted(set(config or {}) - set(cfg))
    if unknown:
        raise ValueError(f"topk_rows config: unknown keys {unknown}; known: {sorted(cfg)}")
    cfg.update(config or {})
    for key, low in (("CHUNK", 16), ("ROWS", 1), ("PARTS", 1), ("FLOOR_N", 1),
                     ("SURVIVOR_CHUNK", 1)):
        value = cfg[key]
        if key == "SURVIVOR_CHUNK" and value is None:
            continue
        if not isinstance(value, int) or value < low or value & (value - 1):
            raise ValueError(f"config {key}={value!r} must be a power of two >= {low}")
    chunk = cfg["CHUNK"]
    cfg["CHUNK"] = max(chunk, V.next_pow2(2 * k))  # each pass must at least halve a row
    # parts of at most 16K columns (the packed scan's 16-bit counts), at most one a column
    cfg["PARTS"] = min(max(cfg["PARTS"], cfg["CHUNK"] // 16384), cfg["CHUNK"])
    return cfg


def _survivor_width(cfg: dict[str, Any], k: int, chunk: int, parts: int) -> int:
    """The register width the pass after the floor searches first: ``SURVIVOR_CHUNK`` within
    [k, chunk] and whole parts, or ``chunk`` (no narrower search)."""
    width = cfg["SURVIVOR_CHUNK"] or chunk
    return min(max(width, V.next_pow2(k), chunk // parts), chunk)


def topk_rows(
    values: torch.Tensor,
    k: int,
    index: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    row_req: torch.Tensor | None = None,
    page_size: int = 1,
    config: dict | None = None,
    floor_max: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest finite entries of each row of ``values`` (N, M) fp32 ->
    ``(values (N, k) fp32, index (N, k) int32)``; see the module docstring for ``index``,
    ``block_table``, ``row_req`` and ``page_size``. ``floor_max`` (N, G) fp32: maxima of
    disjoint groups of each row's entries (``index_scores(group=)``), which let the split
    passes drop entries that cannot win (``topk_split``); the result is the same without."""
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
    if floor_max is not None:
        V.check_tensor("floor_max", floor_max, 2, (torch.float32,), dev)
        V.check_dim("floor_max", floor_max, 0, N, "one row per row of values")
        if floor_max.stride(1) != 1:
            raise ValueError("floor_max must have unit stride along its groups")
    cfg = topk_config(dev, k, config)
    return _split_passes(v, k, idx=index, block_table=block_table, row_req=row_req,
                         page_size=page_size, cfg=cfg, floor_max=floor_max)


def _split_passes(v: torch.Tensor, k: int, idx: torch.Tensor | None,
                  block_table: torch.Tensor | None, row_req: torch.Tensor | None,
                  page_size: int, cfg: dict[str, Any],
                  floor_max: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk_rows`` in split passes (``topk_split``): each compacts its winners; the first may
    drop entries under the floor of ``floor_max``, and the pass after it is then the last."""
    (N, M), dev = v.shape, v.device
    rows = min(cfg["ROWS"], V.next_pow2(N, 1))
    grid_rows = triton.cdiv(N, rows)
    prev: torch.Tensor | None = None  # the previous pass's winners per chunk
    on = pdl(dev)
    floor = floor_max if N else None
    while True:
        # at most _NCB chunks a pass: wider chunks past that (the GPU's 8K: rows past 512K)
        chunk = max(cfg["CHUNK"], V.next_pow2(triton.cdiv(M, _NCB)))
        parts = min(max(cfg["PARTS"], chunk // 16384), chunk)
        num_chunks = max(triton.cdiv(M, chunk), 1)
        floored = prev is not None and floor is not None  # the floor's survivors: the last
        first = _survivor_width(cfg, k, chunk, parts)
        after_floor = floored and (num_chunks > 1 or first < chunk)
        last = num_chunks == 1 or after_floor  # after the floor, one threshold for all chunks
        out_v = torch.empty((N, (1 if last else num_chunks) * k), dtype=torch.float32,
                            device=dev)
        out_i = torch.empty(out_v.shape, dtype=torch.int32, device=dev)
        if N == 0:
            return out_v, out_i
        common = dict(K=k, ROWS=rows, NCB=_NCB, SECANT=bool(cfg["SECANT"]),
                      num_warps=cfg["num_warps"], PDL=on, launch_pdl=on)
        idx_arg = idx if idx is not None else out_i  # never read without HAS_INDEX
        to_slots = block_table is not None and last
        bt = block_table if block_table is not None and last else out_i
        rr = row_req if to_slots and row_req is not None else out_i
        if after_floor and prev is not None:  # search and placement in one launch
            _topk_last_kernel[(num_chunks * parts, grid_rows)](
                v, idx_arg, out_v, out_i, bt, rr, prev, N, M, prev.shape[1], *v.stride(),
                *idx_arg.stride(), *out_v.stride(), *out_i.stride(), *bt.stride(), rr.stride(0),
                prev.stride(0), CHUNK=chunk, FIRST=first, PARTS=parts, PAGE_SIZE=page_size,
                HAS_INDEX=idx is not None, TO_SLOTS=to_slots, HAS_ROW_REQ=row_req is not None,
                **common)
            return out_v, out_i
        meta = torch.empty((N, num_chunks, parts, 4), dtype=torch.int32, device=dev)
        taken = torch.empty((N, num_chunks), dtype=torch.int32, device=dev)
        prev_arg = prev if prev is not None else taken  # never read without HAS_PREV
        num_prev = prev.shape[1] if prev is not None else 0
        use = floor if prev is None and not last else None
        floor_arg = use if use is not None else v  # never read without FLOOR_N
        _topk_search_kernel[(num_chunks, grid_rows)](
            v, meta, taken, prev_arg, floor_arg, N, M, num_prev,
            use.shape[1] if use is not None else 0, *v.stride(), meta.stride(0),
            taken.stride(0), prev_arg.stride(0), floor_arg.stride(0), CHUNK=chunk,
            PARTS=parts, HAS_PREV=prev is not None, PAD=last,
            FLOOR_N=V.next_pow2(cfg["FLOOR_N"]) if use is not None else 0,
            FLOOR_ROUNDS=cfg["FLOOR_ROUNDS"], **common)
        if use is None:
            floor = None  # no floor, or not the first pass
        _topk_place_kernel[(num_chunks * parts, grid_rows)](
            v, idx_arg, out_v, out_i, bt, rr, meta, taken, prev_arg, N, M, num_prev,
            *v.stride(), *idx_arg.stride(), *out_v.stride(), *out_i.stride(), *bt.stride(),
            rr.stride(0), meta.stride(0), taken.stride(0), prev_arg.stride(0), K=k,
            CHUNK=chunk, ROWS=rows, PARTS=parts, NCB=_NCB, HAS_PREV=prev is not None,
            PAD=last, PAGE_SIZE=page_size, HAS_INDEX=idx is not None, TO_SLOTS=to_slots,
            HAS_ROW_REQ=row_req is not None, num_warps=cfg["place_warps"], PDL=on,
            launch_pdl=on)
        if last:
            return out_v, out_i
        v, idx, M, prev = out_v, out_i, num_chunks * k, taken


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
