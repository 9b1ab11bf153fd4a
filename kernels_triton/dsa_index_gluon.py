"""The lightning indexer's decode scores on Hopper, in Gluon (``index_scores``'
``config["gluon"]``: one row a request, e4m3 keys with their scales, pages of a multiple of
64 tokens).

A program owns a chunk of one request's history, ``chunk`` tokens (``_chunk_tiles``: about
``programs_per_sm`` programs an SM over the batch). It quantises the row's query to e4m3 with
a scale a head (amax / 448, as the Triton kernel's e4m3 products do; the scale is positive,
so it moves through the relu into the head weight), stages the chunk's page ids in shared
memory, and streams its 64-token key tiles by TMA (8 KB and their 64 scales a tile,
``STAGES`` in flight). Per tile:

    sᵀ (64 tokens, heads) = keys · q8ᵀ           e4m3 x e4m3, fp32 accumulator
    score (64 tokens)     = Σ_h relu(sᵀ · c_t) · w'_h    c_t = the key's scale x softmax scale

the head sum within each thread's row of the accumulator and across the four lanes that share
it. Scores past the history, and the chunk's tiles past it, are -inf; with ``group`` the
maximum of every ``group`` consecutive scores is stored too (``topk_rows``' floor).

A program's start issues its loads together: the request's row, history and page ids, then
the query rows, then (the ids staged) the first tiles' copies, so one load latency passes
before the first copy instead of three in a row (H200, the DSA layer at batch 16: 16 heads
32K 0.0659 -> 0.0644 ms, 128K 0.1345 -> 0.1339, 128 heads 32K 0.0927 -> 0.0916,
``dsa_index_start.json``).

The Triton kernel streamed the keys at 69-76% of copy bandwidth at 16 rows x 32K / 128K: its
loads went through registers with a page-table gather per tile; here no register holds a key
and the loop's only loads are TMA copies a few tiles ahead.
"""

from __future__ import annotations

import torch
import triton

from splash.kernels_triton import _validate as V
from splash.kernels_triton import mla_decode_gluon_tiles as tiles
from splash.kernels_triton.pdl import pdl

try:  # Gluon ships with Triton 3.5 and later
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from splash.kernels_triton.mla_decode_gluon_tiles import (
        _page_buffer,
        _page_of,
        _pdl_wait,
        _stage_pages,
        _tile_scales,
    )
except ImportError:  # pragma: no cover - an older Triton: the Triton kernel serves
    gluon = None

BT = tiles.BN  # tokens a tile


if gluon is not None:
    GT = gl.constexpr(BT)

    @gluon.jit
    def _load_keys(k_desc, ks_desc, bt_row, stride_btp, t0, pages, start, k_s, ks_s, bar,
                   PS: gl.constexpr):
        """The key tile at token ``t0`` and its scales into ``k_s`` / ``ks_s``, on ``bar``."""
        page = _page_of(bt_row, stride_btp, t0, pages, start, PS)
        mbarrier.expect(bar, k_desc.block_type.nbytes + ks_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [page * PS + t0 % PS, 0], bar, k_s)
        tma.async_copy_global_to_shared(ks_desc, [page, t0 % PS], bar, ks_s)

    @gluon.jit
    def _query_rows(q_ptr, stride_qh, HI, BH: gl.constexpr, I: gl.constexpr,
                    num_warps: gl.constexpr):
        """The row's query, heads past ``HI`` as 0 (its loads issued early)."""
        ld: gl.constexpr = gl.BlockedLayout([1, I // 32], [1, 32], [num_warps, 1], [1, 0])
        h = gl.arange(0, BH, layout=gl.SliceLayout(1, ld))
        c = gl.arange(0, I, layout=gl.SliceLayout(0, ld))
        return gl.load(q_ptr + h[:, None] * stride_qh + c[None, :], mask=(h < HI)[:, None],
                       other=0.0)

    @gluon.jit
    def _quantised(x, w_ptr, stride_wh, HI, softmax_scale, q_s, BH: gl.constexpr):
        """``x`` into ``q_s`` as e4m3 with a scale a head; returns the head weights times those
        scales and the softmax scale."""
        x = x.to(gl.float32)
        scale = gl.maximum(gl.max(gl.abs(x), axis=1), 1e-30) / 448.0
        q_s.store((x / scale[:, None]).to(gl.float8e4nv))
        h = gl.arange(0, BH, layout=scale.type.layout)
        w = gl.load(w_ptr + h * stride_wh, mask=h < HI, other=0.0)
        fence_async_shared()
        gl.thread_barrier()
        return w * scale * softmax_scale

    @gluon.jit
    def _index_scores_gluon_kernel(
        k_desc,  # TMA: index keys (pages * PS, I) e4m3, a tile's 64 rows
        ks_desc,  # TMA: their scales (pages, PS) fp32, a tile's row
        q_ptr, w_ptr, bt_ptr, seq_lens_ptr, q_start_ptr, out_ptr, max_ptr,
        softmax_scale, T, HI, chunk,
        stride_qn, stride_qh, stride_wn, stride_wh, stride_btn, stride_btp, stride_sl,
        stride_qs, stride_on, stride_gn,
        I: gl.constexpr, BH: gl.constexpr, PS: gl.constexpr, STAGES: gl.constexpr,
        GROUP: gl.constexpr, num_warps: gl.constexpr,
    ):
        pid_c = gl.program_id(0)
        b = gl.program_id(1)
        _pdl_wait()
        row = gl.load(q_start_ptr + b * stride_qs)
        row_end = gl.load(q_start_ptr + (b + 1) * stride_qs)
        seq_len = gl.load(seq_lens_ptr + b * stride_sl)
        start = pid_c * chunk
        end = gl.minimum(start + chunk, T)
        bt_row = bt_ptr + b.to(gl.int64) * stride_btn
        pages = _page_buffer()
        _stage_pages(bt_row, stride_btp, start, end, pages, PS, num_warps)
        if row_end > row:
            mma: gl.constexpr = gl.NVMMADistributedLayout(  # e4m3: an MMA's K is 32
                version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BH, 32])
            out1: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
            loaded = (gl.minimum(end, seq_len) - start + GT - 1) // GT  # tiles holding keys
            q_s = gl.allocate_shared_memory(
                gl.float8e4nv, [BH, I], gl.NVMMASharedLayout.get_default_for([BH, I],
                                                                             gl.float8e4nv))
            k_s = gl.allocate_shared_memory(k_desc.dtype, [STAGES, GT, I], k_desc.layout)
            ks_s = gl.allocate_shared_memory(gl.float32, [STAGES, 1, GT], ks_desc.layout)
            bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            x = _query_rows(q_ptr + row.to(gl.int64) * stride_qn, stride_qh, HI, BH, I,
                            num_warps)
            for j in gl.static_range(STAGES):
                mbarrier.init(bars.index(j), count=1)
            gl.thread_barrier()  # the staged page ids, for the first copies too
            for j in gl.static_range(STAGES - 1):  # the first tiles' copies
                if j < loaded:
                    _load_keys(k_desc, ks_desc, bt_row, stride_btp, start + j * GT, pages,
                               start, k_s.index(j), ks_s.index(j), bars.index(j), PS)
            wq = gl.convert_layout(
                _quantised(x, w_ptr + row.to(gl.int64) * stride_wn, stride_wh, HI,
                           softmax_scale, q_s, BH), gl.SliceLayout(0, mma))
            rows_m = gl.arange(0, GT, layout=gl.SliceLayout(1, mma))
            acc0 = gl.zeros((GT, BH), gl.float32, layout=mma)
            out_row = out_ptr + row.to(gl.int64) * stride_on
            max_row = max_ptr + row.to(gl.int64) * stride_gn
            for i in range(loaded):
                st = i % STAGES
                t0 = start + i * GT
                # the stage read last iteration (every warp past its product): the tile
                # STAGES - 1 ahead
                gl.thread_barrier()
                if i + STAGES - 1 < loaded:
                    nx = (i + STAGES - 1) % STAGES
                    _load_keys(k_desc, ks_desc, bt_row, stride_btp, t0 + (STAGES - 1) * GT,
                               pages, start, k_s.index(nx), ks_s.index(nx), bars.index(nx), PS)
                mbarrier.wait(bars.index(st), (i // STAGES) & 1)
                tok = warpgroup_mma(k_s.index(st), q_s.permute((1, 0)), acc0, use_acc=False,
                                    is_async=True)
                s = warpgroup_mma_wait(0, deps=(tok,))
                ks, ok = _tile_scales(ks_s.index(st), t0, seq_len, rows_m)
                score = gl.sum(gl.maximum(s * ks[:, None], 0.0) * wq[None, :], axis=1)
                score = gl.convert_layout(gl.where(ok, score, float("-inf")), out1)
                _store_scores(score, t0, T, out_row, max_row, GROUP, out1)
            for i in range(loaded * GT + start, end, GT):  # the chunk's tiles past the history
                _store_scores(gl.full((GT,), float("-inf"), gl.float32, layout=out1), i, T,
                              out_row, max_row, GROUP, out1)
            for j in gl.static_range(STAGES):
                mbarrier.invalidate(bars.index(j))

    @gluon.jit
    def _store_scores(score, t0, T, out_row, max_row, GROUP: gl.constexpr,
                      layout: gl.constexpr):
        """A tile's 64 scores from column ``t0`` (up to ``T``), and with ``GROUP`` the maxima of
        their groups."""
        cols = t0 + gl.arange(0, GT, layout=layout)
        gl.store(out_row + cols, score, mask=cols < T)
        if GROUP > 0:
            NG: gl.constexpr = GT // GROUP
            gmax = gl.convert_layout(gl.max(gl.reshape(score, [NG, GROUP]), axis=1), layout)
            g = t0 // GROUP + gl.arange(0, NG, layout=layout)
            gl.store(max_row + g, gmax, mask=g < (T + GROUP - 1) // GROUP)


def usable(q: torch.Tensor, cache: torch.Tensor, index_scale: torch.Tensor | None,
           rows_per_request: int | None, group: int, cfg: dict) -> bool:
    """Whether this kernel serves a launch: Hopper, decode (one row a request), e4m3 keys with
    their scales, key widths TMA and the MMA take, and pages of whole tiles."""
    return (gluon is not None and bool(cfg.get("gluon")) and V.compiled_hopper(q)
            and rows_per_request == 1 and cache.dtype == torch.float8_e4m3fn
            and index_scale is not None and cache.shape[2] in (64, 128, 256)
            and q.shape[1] <= 256 and cache.shape[1] % BT == 0 and cache.is_contiguous()
            and group <= BT)


def _chunk_tiles(max_len: int, requests: int, cfg: dict, dev: torch.device) -> int:
    """Tiles a program: about ``programs_per_sm`` programs an SM over the batch, at most the
    staged page ids' worth."""
    want = max(V.num_sms(dev) * cfg["gluon_programs_per_sm"] // max(requests, 1), 1)
    return min(max(triton.cdiv(triton.cdiv(max_len, BT), want), 1), 256)


def launch(q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor,
           block_table: torch.Tensor, seq_lens: torch.Tensor, q_start_loc: torch.Tensor,
           out: torch.Tensor, gmax: torch.Tensor, softmax_scale: float, max_len: int,
           group: int, cfg: dict) -> None:
    """One program a chunk of each request's history (``_chunk_tiles``)."""
    B = seq_lens.shape[0]
    HI, I = q.shape[1], q.shape[2]
    PS = cache.shape[1]
    q = q if q.stride(2) == 1 else q.contiguous()
    chunk = _chunk_tiles(max_len, B, cfg, q.device) * BT
    rows = tiles.kv_rows(cache)
    _index_scores_gluon_kernel[(triton.cdiv(max_len, chunk), B)](
        tiles.descriptor(rows, I), tiles.scale_descriptor(scale), q, weights, block_table,
        seq_lens, q_start_loc, out, gmax, float(softmax_scale), max_len, HI, chunk,
        q.stride(0), q.stride(1), *weights.stride(), *block_table.stride(), seq_lens.stride(0),
        q_start_loc.stride(0), out.stride(0), gmax.stride(0), I=I,
        BH=max(triton.next_power_of_2(HI), 16), PS=PS, STAGES=cfg["gluon_stages"], GROUP=group,
        num_warps=4, launch_pdl=pdl(q.device),
    )
