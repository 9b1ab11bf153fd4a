"""MLA decode for many heads over an e4m3 cache on Hopper, in Gluon, warp-specialised: the
many-head Gluon form (``mla_decode_heads_gluon``: two warpgroups on 64 heads) over e4m3 KV,
fp8 x fp8 scores and the value columns widened to fp16 in shared memory, with the widening and
the tile copies in a warpgroup of their own (``gl.warp_specialize``) beside the two that
multiply.

Partitions of one program, meeting on mbarriers:

    products (8 warps)   tile i's softmax (its rows' scales from the stage), p in fp16 into
                         shared memory, then arrives ``scored`` of the stage (its scores and
                         scales are read); waits ``ready``; issues out += p · wv; issues
                         tile i + 1's scores once it landed; the value product done, arrives
                         ``free``
    widener (4 warps)    per tile: waits for it to land and for ``free``; widens its value
                         columns to fp16 into ``wv`` (rows past a split's end as zeros);
                         arrives ``ready``; once ``scored``, copies the tile ``STAGES`` ahead
                         into the stage (its 64 rows of latent and rope, and their scales)

so the widening (32 K conversions a tile) runs beside the products and the softmax instead of
between them, and the copies wait on nothing but their stage. Before the partitions start,
each program loads its 64 heads' 16-bit q rows (issued ahead of the first tiles' copies) and
quantises them to e4m3 with a scale a head itself, as ``quantise_rows`` does
(``mla_decode_gluon_tiles._quantised_query``), instead of a launch before the kernel that wrote e4m3 q
for the kernel to read again. Two e4m3 stages (36 KB each), the e4m3 query (36 KB), one
widened tile (64 KB) and p (8 KB): 185 KB, one program an SM; the widener keeps 24 registers
a thread, the products 240 (no spills in the loop; the output's stores after it spill
~1.6 KB).

H100, a layer, 128 heads, against the form it replaced (32-head one-warpgroup programs
widening in registers, two an SM; removed once this kernel was faster at every shape, as was
the two-warpgroup kernel widening the values itself between its products, 1.5-1.6x slower)
and bf16 KV in the same run
(``benchmarks/results/h100/decode_heads_fp8_ws.json``), the first form (three stages, q
quantised by a launch before): 64 x 4K 0.2066 -> 0.1760 ms (bf16 0.1752), 64 x 32K 1.519 ->
1.176 (1.301), 8 x 32K 0.2049 -> 0.1770 (0.1784), 2 x 128K 0.2071 -> 0.1682 (0.1791), 64
over 1K-32K 1.425 -> 1.192 (1.272), 128 x 1K 0.1118 -> 0.1077 (0.0985). With the scales
loaded from global memory at each tile's softmax instead, the load's latency sat in front of
it: 64 x 32K 1.423, 128 x 1K 0.1232. Then (``decode_heads_fp8_ws_query.json``, same-process
A/Bs, outputs bit for bit the same): q quantised in the kernel, 128 x 1K 0.1038 -> 0.0926 ms,
64 x 4K 0.175 -> 0.170, 64 x 32K 1.179 -> 1.142, 8 x 32K -2%, 2 x 128K within 1%; two
stages instead of three, 64 x 4K 0.1655 -> 0.1588, 128 x 1K 0.0921 -> 0.0890, 2 x 128K
0.1667 -> 0.1616, 64 over 1K-32K 1.150 -> 1.105. Both, against bf16 in the same run: 64 x 4K
0.1579 ms (bf16 0.1774: 1.12x its tokens a second), 64 x 32K 1.098 (1.311: 1.19x, 532
TFLOP/s), 8 x 32K 0.1638 (0.1815: 1.11x), 2 x 128K 0.1606 (0.1805: 1.12x), 128 x 1K 0.0898
(0.0993: 1.11x), 64 over 1K-32K 1.106 (1.276: 1.15x).

With ``GATHER`` it serves ``mla_sparse`` (e4m3 KV at many heads): a program takes a split of
one row's selected slots, and the widener gathers each tile's 64 rows and their scales by
cp.async (16 bytes a copy, eight threads across a row's latent so that its 24 registers hold
few row addresses), one commit group a tile; once a tile's group has landed it arrives on the
tile's barrier for the products, which mask the slots of -1 (a tile may select nothing). The
first tiles are gathered by the widener too: cp.async groups belong to the threads that issue
them. H100, batch 16 x 2,048 selected rows, 128 heads (``results/h100/dsa_sparse_fp8_ws.json``,
same run): 0.0441 ms against the Triton kernel's 0.0680 and the many-head Gluon kernel's e4m3
form's 0.0609 (bf16 KV's Gluon form 0.0441); the DSA layer at 32K 0.1203 -> 0.1014 ms.
"""

from __future__ import annotations

import torch

from splash.kernels_triton.mla_decode_gluon_tiles import BN, descriptor, kv_rows, scale_descriptor
from splash.kernels_triton.pdl import pdl

try:  # Gluon ships with Triton 3.5 and later
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from splash.kernels_triton.mla_decode_gluon_tiles import (
        _gather_scales,
        _gather_tile,
        _load_tile,
        _plan_item,
        _quantised_query,
        _query_buffers,
        _query_rows,
        _tile_scales,
    )
    from splash.kernels_triton.mla_decode_heads_gluon import (
        _scores,
        _softmax_step,
        _store_heads,
    )
except ImportError:  # pragma: no cover - an older Triton: the other kernels serve
    gluon = None

BH = 64  # heads a program
STAGES = 2  # e4m3 tiles in flight
WIDEN_WARPS = 4
WIDEN_REGS = 24  # registers a widener thread (setmaxnreg): the products' warps keep 240
MAXNREG = 168  # 12 warps an SM: 65,536 registers / 384 threads


def serves(kv: torch.Tensor) -> bool:
    """Whether this kernel takes the many-head Gluon form (``mla_decode_heads_gluon.usable``)
    here: an e4m3 cache, with a Gluon that has ``warp_specialize``."""
    return gluon is not None and kv.dtype == torch.float8_e4m3fn


if gluon is not None:
    GH = gl.constexpr(BH)
    GN = gl.constexpr(BN)
    GS = gl.constexpr(STAGES)
    GW = gl.constexpr(WIDEN_WARPS)
    GR = gl.constexpr(WIDEN_REGS)

    @gluon.jit
    def _widen_rows(k8n, wv, valid, L: gl.constexpr, num_warps: gl.constexpr,
                    MASK: gl.constexpr):
        """The staged e4m3 tile's value columns widened to fp16 into ``wv``; with ``MASK``
        rows ``valid`` and on as zeros."""
        CW: gl.constexpr = 64
        ld: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [num_warps, 1], [1, 0])
        ok = (gl.arange(0, GN, layout=gl.SliceLayout(1, ld)) < valid)[:, None]
        for c in gl.static_range(L // CW):
            x = k8n.slice(c * CW, CW, dim=1).load(ld).to(gl.float16)
            if MASK:
                x = gl.where(ok, x, gl.zeros_like(x))
            wv.slice(c * CW, CW, dim=1).store(x)

    @gluon.jit
    def _widen_values(k8n, wv, valid, L: gl.constexpr, num_warps: gl.constexpr):
        """``_widen_rows``, masking only a split's last, partial tile (a page's unused rows
        may hold NaN, and 0 x NaN is NaN); the mask on every tile cost 8% at 64 x 32K in the
        kernel that widened between its products (2.04 against 1.89 ms)."""
        if valid < GN:
            _widen_rows(k8n, wv, valid, L, num_warps, True)
        else:
            _widen_rows(k8n, wv, valid, L, num_warps, False)

    @gluon.jit
    def _copy_tile(src, bt_row, stride_btp, t0, end, kn, kr, ks, bar, L: gl.constexpr,
                   PS: gl.constexpr, GATHER: gl.constexpr):
        """The tile at ``t0`` into a stage (its rows' scales into ``ks``): its page by TMA,
        signalling ``bar``, or with ``GATHER`` the rows at its slots by cp.async (the caller
        commits the group). ``src``: the TMA descriptors, then the pool and scales' pointers
        and strides."""
        kn_desc, kr_desc, ks_desc, kv_ptr, scale_ptr, stride_kvp, stride_kvs, stride_sp, \
            stride_ss = src
        if GATHER:
            _gather_tile(kv_ptr, bt_row, stride_btp, stride_kvp, stride_kvs, t0, end, kn, kr, L,
                         PS, gl.num_warps(), 8)  # (in 24 registers a thread)
            _gather_scales(ks, scale_ptr, bt_row, stride_btp, stride_sp, stride_ss, t0, end, PS,
                           gl.num_warps())
        else:
            _load_tile(kn_desc, kr_desc, ks_desc, bt_row, stride_btp, t0, kn, kr, ks, bar, L,
                       PS)

    @gluon.jit
    def _widener(kn_s, kr_s, ks_s, wv, tile_bars, ready, free, scored, src, bt_row,
                 stride_btp, start, end, tiles, L: gl.constexpr, PS: gl.constexpr,
                 GATHER: gl.constexpr):
        S: gl.constexpr = kn_s.shape[0]
        if GATHER:  # the first tiles' gathers, a cp.async group each (TMA: issued before)
            for j in gl.static_range(S):
                if j < tiles:
                    _copy_tile(src, bt_row, stride_btp, start + j * GN, end, kn_s.index(j),
                               kr_s.index(j), ks_s.index(j), tile_bars.index(j), L, PS, True)
                async_copy.commit_group()
        for i in range(tiles):
            st = i % S
            t0 = start + i * GN
            if GATHER:  # tile i's group landed (one group a tile): the products may score it
                async_copy.wait_group(S - 1)
                fence_async_shared()
                gl.thread_barrier()
                mbarrier.arrive(tile_bars.index(st), count=1)
            else:
                mbarrier.wait(tile_bars.index(st), (i // S) & 1)
            mbarrier.wait(free, (i & 1) ^ 1)  # the value product before is done with wv
            _widen_values(kn_s.index(st), wv, end - t0, L, gl.num_warps())
            fence_async_shared()
            mbarrier.arrive(ready, count=1)
            if i + S < tiles:  # the stage again once both have read it
                mbarrier.wait(scored.index(st), (i // S) & 1)
                fence_async_shared()
                _copy_tile(src, bt_row, stride_btp, t0 + S * GN, end, kn_s.index(st),
                           kr_s.index(st), ks_s.index(st), tile_bars.index(st), L, PS, GATHER)
            if GATHER:
                async_copy.commit_group()

    @gluon.jit
    def _chosen(bt_row, stride_btp, t0, end, cols):
        """Which of a gathered tile's ``cols`` (from ``t0``) hold a token: before ``end`` and
        of a slot other than -1 (``bt_row``: the row's slot list)."""
        ok = t0 + cols < end
        return gl.load(bt_row + (t0 + cols) * stride_btp, mask=ok, other=-1) >= 0

    @gluon.jit
    def _products(qn_s, qr_s, kn_s, kr_s, ks_s, wv, p_s, tile_bars, ready, free, scored,
                  qsc, bt_row, stride_btp, start, end, tiles, L: gl.constexpr,
                  mma_s: gl.constexpr, mma_o: gl.constexpr, GATHER: gl.constexpr):
        S: gl.constexpr = kn_s.shape[0]
        acc = gl.zeros((GH, L), gl.float32, layout=mma_o)
        m_i = gl.full((GH,), float("-inf"), gl.float32, layout=gl.SliceLayout(1, mma_s))
        l_acc = gl.zeros((GH, GN), gl.float32, layout=mma_s)
        cols = gl.arange(0, GN, layout=gl.SliceLayout(0, mma_s))
        s = gl.zeros((GH, GN), gl.float32, layout=mma_s)
        ok = cols < 0
        if GATHER:  # tile 0's slots
            ok = _chosen(bt_row, stride_btp, start, end, cols)
        if tiles > 0:  # tile 0's scores
            mbarrier.wait(tile_bars.index(0), 0)
            s = warpgroup_mma_wait(0, deps=(_scores(qn_s, qr_s, kn_s.index(0), kr_s.index(0),
                                                    s),))
        for i in range(tiles):  # s: tile i's scores
            t0 = start + i * GN
            if GATHER:  # (ok: taken under the MMAs before)
                ks = _tile_scales(ks_s.index(i % S), t0, end, cols)[0]
            else:
                ks, ok = _tile_scales(ks_s.index(i % S), t0, end, cols)
            p, alpha, m_i, l_acc = _softmax_step(s * qsc[:, None] * ks[None, :], ok, m_i,
                                                 l_acc, GATHER)  # (a gathered tile: maybe empty)
            p_s.store((p * ks[None, :]).to(gl.float16))  # both warpgroups' halves of p
            alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, mma_o))
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(scored.index(i % S), count=1)  # the stage's scores, scales read
            mbarrier.wait(ready, i & 1)
            acc_tok = warpgroup_mma(p_s, wv, acc * alpha_o[:, None], is_async=True)
            if i + 1 < tiles:
                st = (i + 1) % S
                mbarrier.wait(tile_bars.index(st), ((i + 1) // S) & 1)
                s_tok = _scores(qn_s, qr_s, kn_s.index(st), kr_s.index(st), s)
                if GATHER:  # the next tile's slots, under the MMAs
                    ok = _chosen(bt_row, stride_btp, t0 + GN, end, cols)
                acc = warpgroup_mma_wait(1, deps=(acc_tok,))
                gl.thread_barrier()
                mbarrier.arrive(free, count=1)
                s = warpgroup_mma_wait(0, deps=(s_tok,))
            else:
                acc = warpgroup_mma_wait(0, deps=(acc_tok,))
        return acc, m_i, l_acc

    @gluon.jit(do_not_specialize=["splits"])  # (as heads_gluon's kernel: Triton 3.6)
    def _mla_decode_heads_fp8_ws_kernel(
        kn_desc, kr_desc,  # TMA: kv (pages * PS, L + R) e4m3
        ks_desc,  # TMA: the rows' scales (pages, PS) fp32, a tile's row
        bt_ptr, o_ptr, o_low_ptr, lse_ptr, out_ptr, lse_out_ptr, plan_ptr,  # as heads_gluon's
        q_ptr, stride_qn, stride_qh,  # q (N, H, L + R), 16-bit, quantised here
        kv_ptr, scale_ptr,  # GATHER: the pool (pages, PS, L + R) and its scales (pages, PS)
        qk_scale, H, N,
        splits, split_len, K,  # GATHER: bt_ptr is (N, K) slots, each row's in these splits
        stride_kvp, stride_kvs, stride_sp, stride_ss,
        stride_btn, stride_btp,
        stride_os, stride_oh,
        stride_ls,
        stride_outn, stride_outh,
        stride_lon,
        L: gl.constexpr, R: gl.constexpr, PS: gl.constexpr, LOW_SPLITS: gl.constexpr,
        GATHER: gl.constexpr, num_warps: gl.constexpr,
    ):
        g = gl.program_id(0)
        pid = gl.program_id(1)
        n, count, start, end = _plan_item(plan_ptr, pid, N, splits, split_len, K, GATHER)
        if n < N:
            mma_s: gl.constexpr = gl.NVMMADistributedLayout(  # fp8: an MMA's K is 32
                version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, GN // 2, 32])
            mma_o: gl.constexpr = gl.NVMMADistributedLayout(
                version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, L // 2, 16])
            qn_s, qr_s = _query_buffers(GH, L, R)
            kn_s = gl.allocate_shared_memory(kn_desc.dtype, [GS, GN, L], kn_desc.layout)
            kr_s = gl.allocate_shared_memory(kr_desc.dtype, [GS, GN, R], kr_desc.layout)
            ks_s = gl.allocate_shared_memory(gl.float32, [GS, 1, GN], ks_desc.layout)
            wv = gl.allocate_shared_memory(
                gl.float16, [GN, L], gl.NVMMASharedLayout.get_default_for([GN, L], gl.float16))
            p_s = gl.allocate_shared_memory(  # p, the value product's A operand
                gl.float16, [GH, GN], gl.NVMMASharedLayout.get_default_for([GH, GN], gl.float16))
            tile_bars = gl.allocate_shared_memory(gl.int64, [GS, 1],
                                                  mbarrier.MBarrierLayout())
            scored = gl.allocate_shared_memory(gl.int64, [GS, 1], mbarrier.MBarrierLayout())
            bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(GS):
                mbarrier.init(tile_bars.index(i), count=1)
                mbarrier.init(scored.index(i), count=1)
            for i in gl.static_range(2):  # wv ready, wv free
                mbarrier.init(bars.index(i), count=1)
            bt_row = bt_ptr + n.to(gl.int64) * stride_btn
            tiles = (end - start + GN - 1) // GN
            xn, xr = _query_rows(q_ptr + n.to(gl.int64) * stride_qn + g * GH * stride_qh,
                                 stride_qh, H - g * GH, L, R, GH, num_warps)
            src = (kn_desc, kr_desc, ks_desc, kv_ptr, scale_ptr, stride_kvp, stride_kvs,
                   stride_sp, stride_ss)
            if not GATHER:  # (gathered tiles: by the widener, whose cp.async groups they are)
                for j in gl.static_range(GS):
                    if j < tiles:
                        _load_tile(kn_desc, kr_desc, ks_desc, bt_row, stride_btp,
                                   start + j * GN, kn_s.index(j), kr_s.index(j), ks_s.index(j),
                                   tile_bars.index(j), L, PS)
            qs = _quantised_query(xn, xr, qn_s, qr_s, L, R, num_warps)
            qsc = gl.convert_layout(qs, gl.SliceLayout(1, mma_s)) * qk_scale
            acc, m_i, l_acc = gl.warp_specialize([
                (_products, (qn_s, qr_s, kn_s, kr_s, ks_s, wv, p_s, tile_bars, bars.index(0),
                             bars.index(1), scored, qsc, bt_row, stride_btp, start, end, tiles,
                             L, mma_s, mma_o, GATHER)),
                (_widener, (kn_s, kr_s, ks_s, wv, tile_bars, bars.index(0), bars.index(1),
                            scored, src, bt_row, stride_btp, start, end, tiles, L, PS,
                            GATHER)),
            ], [GW], [GR])
            for i in gl.static_range(GS):
                mbarrier.invalidate(tile_bars.index(i))
                mbarrier.invalidate(scored.index(i))
            for i in gl.static_range(2):
                mbarrier.invalidate(bars.index(i))
            _store_heads(acc, m_i, l_acc, g, pid, n, count, H, o_ptr, o_low_ptr, lse_ptr,
                         out_ptr, lse_out_ptr, stride_os, stride_oh, stride_ls, stride_outn,
                         stride_outh, stride_lon, L, LOW_SPLITS, mma_s, mma_o, num_warps)


def launch(q: torch.Tensor, kv: torch.Tensor, scale: torch.Tensor, block_table: torch.Tensor,
           o_part: torch.Tensor, o_low: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor,
           lse: torch.Tensor, items: torch.Tensor | None, qk_scale: float, low: int,
           sparse: tuple[int, int] | None = None) -> None:
    """Head groups of 64 x one program per plan item (``mla_decode``'s balanced plan), each
    quantising its 64 heads' q rows to e4m3 with a scale a head itself. With ``sparse`` =
    (splits, split_len), ``block_table`` is ``mla_sparse``'s (N, K) slots and the programs
    are each row's splits (partial rows (splits * N, 1, H, L), split-major), without a plan,
    as ``mla_decode_heads_gluon.launch`` takes them."""
    N, H, D = q.shape
    L = out.shape[2]
    q = q if q.stride(2) == 1 else q.contiguous()
    rows_kv = kv_rows(kv)
    splits, split_len = sparse or (1, 0)
    programs = items.shape[0] if items is not None else splits * N
    _mla_decode_heads_fp8_ws_kernel[((H + BH - 1) // BH, programs)](
        descriptor(rows_kv, L), descriptor(rows_kv, D - L), scale_descriptor(scale),
        block_table, o_part, o_low, lse_part, out, lse,
        block_table if items is None else items, q, q.stride(0), q.stride(1), kv, scale,
        qk_scale, H, N, splits, split_len, block_table.shape[1], kv.stride(0), kv.stride(1),
        scale.stride(0), scale.stride(1), block_table.stride(0),
        block_table.stride(1), o_part.stride(0), o_part.stride(2), lse_part.stride(0),
        out.stride(0), out.stride(1), lse.stride(0), L=L, R=D - L, PS=kv.shape[1],
        LOW_SPLITS=low, GATHER=sparse is not None, num_warps=8, maxnreg=MAXNREG,
        launch_pdl=pdl(q.device),
    )
