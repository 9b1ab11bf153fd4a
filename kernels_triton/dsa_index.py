"""The lightning indexer's scores over a paged indexer-key pool (DeepSeek Sparse Attention).

Per query row n and history token t, with ``HI`` index heads of width ``I``:

    score[n, t] = sum_h w[n, h] * relu(softmax_scale * q[n, h] · k[t])

``k`` is the row's single-head indexer key (``I`` dims), stored beside the latent KV row in the
same slot of a pool ``(P, PS, I)`` (fp8 with a per-token fp32 scale, or a float dtype; written
by ``kv_write``). ``w`` (fp32) are the per-row head weights, ``weights_proj(x) * HI^-0.5`` as the
model computes them. The rows are laid out like ``mla_extend``'s: request b owns rows
[q_start_loc[b], q_start_loc[b+1]) and row j of it sits at position ``seq_lens[b] - n_b + j``;
it sees tokens [0, pos] (a decode row: its whole history; a row of a shard shorter than its
rows, as a CP rank's share of a history can be, sees nothing). Unseen tokens score ``-inf``, so
the output ``(Nq, T)`` (T = ``max_len``) feeds ``topk_rows`` directly.

A program owns ``BLOCK_M`` rows of one request and ``TILES`` key tiles of ``BLOCK_T`` tokens:
the rows' queries, flattened to (BLOCK_M·HI, I), load once and meet each key tile in one
tensor-core dot, then the head-weighted relu sum folds the heads away. The keys of the
history are read once per row block, which is the kernel's whole memory traffic (decode rows
are memory bound; prefill row blocks share each key tile). fp8 keys widen exactly to the dot's
operand dtype (fp16 with ``config["fp8_fp16"]``, the CUDA default: q is clamped to fp16's range
and cast once) and the token's scale multiplies its score column. With ``config["fp8_dot"]``
(fp8 keys, NVIDIA sm_89+) the products run on e4m3 operands instead, as the reference
implementations' indexers do: each (row, head) query is scaled to e4m3's range (amax / 448) and
rounded once, and since that scale is positive it moves through the relu into the head weight.
``config["tokens_m"]`` puts the key tile on the product's M side instead of the queries (the
head sum then stays within each thread's row of the accumulator, and the widened keys can
feed the product from registers).

With ``group_max`` the kernel also writes the maximum of every ``group`` consecutive columns
(8 in the engine) from the scores in registers: the bound ``topk_rows`` drops entries by.

Decode rows (``max_rows=1``) over e4m3 keys on Hopper run the Gluon kernel instead
(``config["gluon"]``, ``dsa_index_gluon``): TMA key tiles, the same e4m3 products; 0.0241 /
0.0818 -> 0.0229 / 0.0761 ms at 16 rows x 32K / 128K (``dsa_index_gluon.json``).

Latency (H200, 16 decode rows): ncu found the kernel waiting on global loads (2.8 TB/s, 23%
occupancy): a page-table load in the loop, which each tile's addresses depend on, kept Triton's
pipeliner (3.6) from running copies ahead. ``config["gather_pages"]`` (the default): a program
loads its page ids once (``PAGES``, a power of two, at most 256) and each tile gathers its
rows' ids from those registers (``tl.gather``); the fp8 key scales load one tile ahead (0.0343
/ 0.1006 -> 0.0318 / 0.0941 ms at 32K / 128K); a decode launch told ``max_rows=1`` runs only
the row blocks requests have (the grid's row axis, bounded by the rows, held 15 empty programs
for each busy one at batch 16): 0.0320 / 0.0932 -> 0.0233 / 0.0865 ms. Not faster: 64-token
tiles (0.0316 / 0.0978 at best); the next key tile in registers ahead of the product (200
registers); keys and scales through tensor descriptors (TMA, a page a tile, 3-6 stages:
0.0341-0.0403 / 0.0947-0.0991 ms against 0.0319 / 0.0951); tiles a program of any count for
one wave of three programs an SM (11 / 43 tiles: 0.0234 / 0.0830 against 0.0227 / 0.0851,
``dsa_index_wave.json``: 2.5% at 128K, not worth a binary per count).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from splash.kernels_triton import _validate as V
from splash.kernels_triton import dsa_index_gluon
from splash.kernels_triton.dsa_index_tiles import (
    _store_maxima,
    _tile_col,
    _tile_keys,
    _tile_pages,
    _tile_scores,
)
from splash.kernels_triton.mla_decode_kernels import _q_operand
from splash.kernels_triton.paged_ids import _load_page_ids
from splash.kernels_triton.pdl import pdl, pdl_enter

# ints that vary by step: one binary for all (tests check the warm-up against them)
SHAPE_INTS = ["stride_btn", "stride_gn"]


@triton.jit(do_not_specialize=SHAPE_INTS)
def _index_scores_kernel(
    q_ptr,  # (Nq, HI, I)
    w_ptr,  # (Nq, HI) fp32
    k_ptr,  # (P, PS, I)
    ks_ptr,  # (P, PS) fp32 (fp8 keys)
    bt_ptr,  # (B, max_pages) int
    seq_lens_ptr,  # (B,) int
    q_start_ptr,  # (B + 1,) int
    out_ptr,  # (Nq, T) fp32
    max_ptr,  # (Nq, cdiv(T, GROUP)) fp32 (GROUP > 0)
    softmax_scale,
    T,
    stride_qn, stride_qh, stride_qd,
    stride_wn, stride_wh,
    stride_kp, stride_ks, stride_kd,
    stride_sp, stride_ss,
    stride_btn, stride_btp,
    stride_sl,
    stride_qs,
    stride_on, stride_ot,
    stride_gn, stride_og,
    HI: tl.constexpr,
    I: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_T: tl.constexpr,
    TILES: tl.constexpr,
    IS_FP8: tl.constexpr,
    FP8_FP16: tl.constexpr,
    FP8_DOT: tl.constexpr,
    TOKENS_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PAGES: tl.constexpr,  # > 0: page ids gathered from the program's PAGES, loaded once
    GROUP: tl.constexpr = 0,  # > 0: also each GROUP tokens' maximum (topk_rows' floor)
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    pid_t = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_b = tl.program_id(2)
    row_start = tl.load(q_start_ptr + pid_b * stride_qs).to(tl.int32)
    n_rows = tl.load(q_start_ptr + (pid_b + 1) * stride_qs).to(tl.int32) - row_start
    m0 = pid_m * BLOCK_M
    if m0 < n_rows:
        seq_len = tl.load(seq_lens_ptr + pid_b * stride_sl).to(tl.int32)
        offs_mh = tl.arange(0, BLOCK_M * BLOCK_H)  # (m, h) flattened
        row_mh = m0 + offs_mh // BLOCK_H
        head = offs_mh % BLOCK_H
        mask_mh = (row_mh < n_rows) & (head < HI)
        offs_i = tl.arange(0, BLOCK_I)
        q = tl.load(
            q_ptr + (row_start + row_mh).to(tl.int64)[:, None] * stride_qn
            + head[:, None] * stride_qh + offs_i[None, :] * stride_qd,
            mask=mask_mh[:, None] & (offs_i < I)[None, :], other=0.0,
        )  # (BLOCK_M * BLOCK_H, BLOCK_I)
        w = tl.load(w_ptr + (row_start + row_mh).to(tl.int64) * stride_wn + head * stride_wh,
                    mask=mask_mh, other=0.0)  # (BLOCK_M * BLOCK_H,)
        if FP8_DOT:  # q to e4m3 per (row, head); its scale (> 0) passes relu into the weight
            q = q.to(tl.float32)
            q_scale = tl.maximum(tl.max(tl.abs(q), axis=1), 1e-30) / 448.0
            q = (q / q_scale[:, None]).to(tl.float8e4nv)
            w = w * q_scale
        else:
            q = _q_operand(q, IS_FP8, FP8_FP16)
        rows = m0 + tl.arange(0, BLOCK_M)
        mask_m = rows < n_rows
        pos = seq_len - n_rows + rows  # (BLOCK_M,) absolute positions
        bt_row = bt_ptr + pid_b * stride_btn
        out_rows = out_ptr + (row_start + rows).to(tl.int64)[:, None] * stride_on
        max_rows = max_ptr + (row_start + rows).to(tl.int64)[:, None] * stride_gn
        t_lo = pid_t * (TILES * BLOCK_T)
        t_hi = tl.minimum(t_lo + TILES * BLOCK_T, T)
        # tiles holding keys: a loop with bounds, which the compiler pipelines
        t_keys = tl.maximum(tl.minimum(t_hi, seq_len) - t_lo, 0)
        t_mid = t_lo + tl.cdiv(t_keys, BLOCK_T) * BLOCK_T
        lim = tl.minimum(seq_len, t_mid)
        first_page = t_lo // PAGE_SIZE
        pages = first_page  # unused without PAGES
        if PAGES > 0:  # the program's page ids, once: the loop's loads then pipeline
            pages = _load_page_ids(bt_row, first_page, lim, stride_btp, PAGE_SIZE, PAGES)
        # the key scales, a register load the pipeliner leaves in the loop, one tile ahead
        page, slot, mask_t = _tile_pages(bt_row, pages, first_page, t_lo, lim, stride_btp,
                                         PAGE_SIZE, BLOCK_T, PAGES)
        col_next = _tile_col(ks_ptr, page, slot, mask_t, softmax_scale, stride_sp, stride_ss,
                             BLOCK_T, IS_FP8)
        for t0 in range(t_lo, t_mid, BLOCK_T):
            col = col_next
            page, slot, mask_t = _tile_pages(bt_row, pages, first_page, t0, lim, stride_btp,
                                             PAGE_SIZE, BLOCK_T, PAGES)
            k = _tile_keys(k_ptr, page, slot, mask_t, stride_kp, stride_ks, stride_kd, q.dtype,
                           I, BLOCK_I, IS_FP8, FP8_DOT)
            page, slot, mask_t = _tile_pages(bt_row, pages, first_page, t0 + BLOCK_T, lim,
                                             stride_btp, PAGE_SIZE, BLOCK_T, PAGES)
            col_next = _tile_col(ks_ptr, page, slot, mask_t, softmax_scale, stride_sp,
                                 stride_ss, BLOCK_T, IS_FP8)
            _tile_scores(q, w, k, col, t0, pos, mask_m, out_rows, T, stride_ot, max_rows,
                         stride_og, BLOCK_M, BLOCK_H, BLOCK_T, TOKENS_M, DOT_PRECISION, GROUP)
        for t0 in range(t_mid, t_hi, BLOCK_T):  # columns past the history
            offs_t = t0 + tl.arange(0, BLOCK_T)
            unseen = tl.full((BLOCK_M, BLOCK_T), float("-inf"), tl.float32)
            tl.store(out_rows + offs_t[None, :] * stride_ot, unseen,
                     mask=mask_m[:, None] & (offs_t < T)[None, :])
            _store_maxima(unseen, t0, mask_m, max_rows, T, stride_og, BLOCK_M, BLOCK_T, GROUP)


# ---------------------------------------------------------------------------------------------
# launcher

# GPU (H200, benchmarks/dsa_sweep.py, 16 decode rows, 64 index heads, fp8 keys): e4m3
# products with the keys on M, 0.0375 / 0.1036 ms at 32K / 128K against 0.0656 / 0.2275 for
# fp16 products with the queries on M; gathered page ids, 3 stages, 16 tiles a program (4, 8
# and 32 lose: 0.028 / 0.028 / 0.029 ms at 32K against 0.023, dsa_index_gather_tiles.json).
# TILES None: tiles per program for about ``_PROGRAMS`` programs, at most ``_MAX_TILES``.
# Prefill row blocks run on ``num_warps_extend``: a (128 tokens, 4 rows x 64 heads) fp32
# product held 256 registers a thread on 4 warps; on 8, 2,048 rows over 32K / 64K took 4.76 /
# 9.52 -> 1.67 / 3.30 ms (224 -> 640-656 TFLOP/s); 2 rows a block on 4 warps 1.83 / 3.62.
# Decode over e4m3 keys on Hopper: the Gluon kernel (``config["gluon"]``, ``dsa_index_gluon``),
# ``gluon_stages`` key tiles in flight, about ``gluon_programs_per_sm`` programs an SM.
_GPU_DEFAULTS: dict[str, Any] = {"BLOCK_T": 128, "TILES": None, "BLOCK_M_EXTEND": 4,
                                 "num_warps": 4, "num_warps_extend": 8, "num_stages": 3,
                                 "fp8_fp16": True, "fp8_dot": True, "tokens_m": True,
                                 "gather_pages": True, "gluon": True, "gluon_stages": 4,
                                 "gluon_programs_per_sm": 4}
_CPU_DEFAULTS: dict[str, Any] = {"BLOCK_T": 128, "TILES": 1, "BLOCK_M_EXTEND": 16, "num_warps": 4,
                                 "num_warps_extend": 4, "num_stages": 1, "fp8_fp16": False,
                                 "fp8_dot": False, "tokens_m": False, "gather_pages": True,
                                 "gluon": False, "gluon_stages": 4, "gluon_programs_per_sm": 4}


def index_config(device: torch.device, config: dict | None) -> dict[str, Any]:
    cfg = dict(_GPU_DEFAULTS if device.type == "cuda" else _CPU_DEFAULTS)
    if device.type == "cuda" and torch.version.hip is not None:
        # measured on CUDA only: ROCm keeps the plain products and per-tile page ids
        cfg.update(fp8_fp16=False, gather_pages=False, num_stages=2, num_warps_extend=4,
                   gluon=False)
    unknown = sorted(set(config or {}) - set(cfg))
    if unknown:
        raise ValueError(f"index_scores config: unknown keys {unknown}; known: {sorted(cfg)}")
    cfg.update(config or {})
    if cfg["fp8_dot"] and device.type == "cuda" and (
            torch.version.hip is not None or torch.cuda.get_device_capability(device) < (8, 9)):
        cfg["fp8_dot"] = False  # e4m3 tensor-core products: NVIDIA sm_89 and later
    tiles = cfg["TILES"]
    if tiles is not None and (not isinstance(tiles, int) or tiles < 1):
        raise ValueError(f"config TILES={tiles!r} must be None or an int >= 1")
    for key, low in (("BLOCK_T", 16), ("BLOCK_M_EXTEND", 1)):
        value = cfg[key]
        if not isinstance(value, int) or value < low or value & (value - 1):
            raise ValueError(f"config {key}={value!r} must be a power of two >= {low}")
    return cfg


_PROGRAMS = 256
_MAX_TILES = 16


def _auto_tiles(max_len: int, block_t: int, row_blocks: int) -> int:
    """Key tiles per program: the most (up to ``_MAX_TILES``, a power of two) that still leave
    about ``_PROGRAMS`` programs over ``row_blocks`` row blocks."""
    tiles = 1
    while (tiles < _MAX_TILES
           and triton.cdiv(max_len, block_t * tiles * 2) * row_blocks >= _PROGRAMS):
        tiles *= 2
    return tiles


def _gathered_pages(cfg: dict[str, Any], per_program: int, page_size: int) -> int:
    """PAGES for a program of ``per_program`` tokens (one page more for a start inside a
    page), or 0: page ids loaded per tile."""
    return V.gathered_ids(triton.cdiv(per_program, page_size) + 1, cfg["gather_pages"], 256)


def tile_counts(device: torch.device, config: dict | None) -> list[int]:
    """Every ``TILES`` an ``index_scores`` launch can take: the configured count, or each
    power of two ``_auto_tiles`` may pick (it grows with the history and with the rows)."""
    cfg = index_config(device, config)
    if cfg["TILES"]:
        return [int(cfg["TILES"])]
    return [1 << i for i in range(_MAX_TILES.bit_length())]


def index_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    q_start_loc: torch.Tensor,
    softmax_scale: float,
    max_len: int,
    index_scale: torch.Tensor | None = None,
    config: dict | None = None,
    max_rows: int | None = None,
    group_max: torch.Tensor | None = None,
    group: int = 8,
) -> torch.Tensor:
    """Indexer scores ``(Nq, max_len)`` fp32 of ``q`` (Nq, HI, I) with head ``weights`` (Nq, HI)
    fp32 against the paged keys ``index_cache`` (P, PS, I) (+ ``index_scale`` (P, PS) when fp8);
    rows grouped by request as in ``mla_extend`` (``q_start_loc`` (B+1,), ``seq_lens`` (B,)
    including the rows). Tokens a row does not see, and columns past its history, are -inf.
    ``max_rows``: the most rows any one request has, when the caller knows it (1 for decode);
    None bounds it by Nq without a host sync, launching programs for row blocks that requests
    do not have (they exit at once, but at batch 16 decode they were 15 of every 16).
    ``group_max`` (Nq, cdiv(max_len, group)) fp32, when given, receives the maximum of each
    ``group`` (a power of two <= BLOCK_T) consecutive columns: ``topk_rows``' floor."""
    V.check_tensor("q", q, 3, V.FLOAT_DTYPES)
    dev = q.device
    cache = V.check_tensor("index_cache", index_cache, 3, V.KV_DTYPES, dev)
    V.check_unit_stride("index_cache", cache)
    V.check_kv_scale(cache, index_scale)
    if not V.is_fp8(cache.dtype) and cache.dtype != q.dtype:
        raise ValueError(f"q is {q.dtype} but index_cache is {cache.dtype}; they must match "
                         "(or fp8 keys)")
    Nq, HI, I = q.shape
    V.check_dim("q", q, 2, cache.shape[2], "the indexer key width of index_cache")
    V.check_tensor("weights", weights, 2, (torch.float32,), dev)
    if tuple(weights.shape) != (Nq, HI):
        raise ValueError(f"weights has shape {tuple(weights.shape)}; expected {(Nq, HI)}")
    V.check_tensor("block_table", block_table, 2, V.INDEX_DTYPES, dev)
    V.check_tensor("seq_lens", seq_lens, 1, V.INDEX_DTYPES, dev)
    V.check_tensor("q_start_loc", q_start_loc, 1, V.INDEX_DTYPES, dev)
    B = seq_lens.shape[0]
    V.check_dim("q_start_loc", q_start_loc, 0, B + 1, "B + 1 for B = len(seq_lens)")
    V.check_dim("block_table", block_table, 0, B, "one row per request")
    if not isinstance(max_len, int) or max_len < 0:
        raise ValueError(f"max_len={max_len!r} must be an int >= 0")
    P, PS = cache.shape[0], cache.shape[1]
    if V.value_checks_enabled() and B:
        n_rows = q_start_loc[1:].long() - q_start_loc[:-1].long()
        if int(q_start_loc[0]) != 0 or int(q_start_loc[-1]) != Nq or bool((n_rows < 0).any()):
            raise ValueError(f"q_start_loc must rise from 0 to Nq={Nq}")
        if bool((seq_lens < 0).any()) or int(seq_lens.max()) > max_len:
            raise ValueError(f"seq_lens must lie in [0, max_len={max_len}]")
        V.check_paged_lengths(block_table, seq_lens, PS, P)
    out = torch.empty((Nq, max_len), dtype=torch.float32, device=dev)
    cfg = index_config(dev, config)
    if group_max is not None:
        if not isinstance(group, int) or group < 1 or group & (group - 1) or group > cfg[
                "BLOCK_T"]:
            raise ValueError(f"group={group!r} must be a power of two <= BLOCK_T "
                             f"({cfg['BLOCK_T']})")
        V.check_tensor("group_max", group_max, 2, (torch.float32,), dev)
        want = (Nq, triton.cdiv(max_len, group))
        if tuple(group_max.shape) != want:
            raise ValueError(f"group_max has shape {tuple(group_max.shape)}; expected {want}")
    if Nq == 0 or max_len == 0 or B == 0:
        return out
    V.check_max_rows(q_start_loc, max_rows)
    if dsa_index_gluon.usable(q, cache, index_scale, max_rows,
                              group if group_max is not None else 0, cfg):
        dsa_index_gluon.launch(q, weights, cache, index_scale, block_table, seq_lens, q_start_loc,
                               out, group_max if group_max is not None else out, softmax_scale,
                               max_len, group if group_max is not None else 0, cfg)
        return out
    block_m = 1 if Nq == B else cfg["BLOCK_M_EXTEND"]  # decode: one row per request
    block_h = V.next_pow2(HI, max(16 // block_m, 1))  # the dot's M side is >= 16
    num_m_blocks = triton.cdiv(V.row_bound(max_rows, Nq), block_m)  # of any one request
    busy = min(B * num_m_blocks, triton.cdiv(Nq, block_m) + B - 1)  # those holding rows, at most
    tiles = cfg["TILES"] or _auto_tiles(max_len, cfg["BLOCK_T"], busy)
    per_program = cfg["BLOCK_T"] * tiles
    if B > 65535 or num_m_blocks > 65535:
        raise ValueError(f"index_scores takes at most 65535 requests and row blocks; got B={B}")
    fp8 = V.is_fp8(cache.dtype)
    fp16 = fp8 and bool(cfg["fp8_fp16"])
    scale = index_scale if index_scale is not None else out  # never read unless fp8
    gmax = group_max if group_max is not None else out  # never written without GROUP
    _index_scores_kernel[(triton.cdiv(max_len, per_program), num_m_blocks, B)](
        q, weights, cache, scale, block_table, seq_lens, q_start_loc, out, gmax,
        float(softmax_scale), max_len,
        *q.stride(), *weights.stride(), *cache.stride(),
        *(index_scale.stride() if index_scale is not None else (0, 0)),
        *block_table.stride(), seq_lens.stride(0), q_start_loc.stride(0), *out.stride(),
        *gmax.stride(), GROUP=group if group_max is not None else 0,
        HI=HI, I=I, PAGE_SIZE=PS, BLOCK_M=block_m, BLOCK_H=block_h, BLOCK_I=V.next_pow2(I),
        BLOCK_T=cfg["BLOCK_T"], TILES=tiles, IS_FP8=fp8, FP8_FP16=fp16,
        FP8_DOT=fp8 and bool(cfg["fp8_dot"]), TOKENS_M=bool(cfg["tokens_m"]),
        PAGES=_gathered_pages(cfg, per_program, PS),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 and not fp16 else None,
        num_warps=cfg["num_warps_extend" if block_m > 1 else "num_warps"],
        num_stages=cfg["num_stages"], PDL=(on := pdl(dev)), launch_pdl=on,
    )
    return out


# ---------------------------------------------------------------------------------------------
# reference


def index_scores_ref(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    q_start_loc: torch.Tensor,
    softmax_scale: float,
    max_len: int,
    index_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference of ``index_scores`` (fp64 math, one request at a time), written as the
    transformers indexer computes it: relu(q·kᵀ · scale), then the head weights' matmul."""
    Nq = q.shape[0]
    PS = index_cache.shape[1]
    out = torch.full((Nq, max_len), float("-inf"), dtype=torch.float64, device=q.device)
    for b in range(seq_lens.shape[0]):
        lo, hi, length = int(q_start_loc[b]), int(q_start_loc[b + 1]), int(seq_lens[b])
        if hi == lo:
            continue
        pages = block_table[b, : -(-length // PS)].long()
        keys = index_cache[pages].double()  # (pages, PS, I)
        if index_scale is not None:
            keys = keys * index_scale[pages].double()[..., None]
        keys = keys.reshape(-1, index_cache.shape[2])[:length]  # (len, I)
        scores = torch.relu(torch.einsum("nhd,td->nht", q[lo:hi].double(), keys) * softmax_scale)
        total = torch.einsum("nh,nht->nt", weights[lo:hi].double(), scores)  # (n, len)
        pos = length - (hi - lo) + torch.arange(hi - lo, device=q.device)
        seen = torch.arange(length, device=q.device)[None, :] <= pos[:, None]
        out[lo:hi, :length] = total.masked_fill(~seen, float("-inf"))
    return out.float()
