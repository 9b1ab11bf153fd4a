"""MLA decode for few heads over an e4m3 cache on Hopper, in Gluon: the tokens-on-M form
(``mla_decode_tokens_gluon``) with both products fed from the fp8 tile as it landed, so no
widened copy of the tile passes through shared memory (``config["fp8_query"]``).

Per 64-token tile, staged by TMA two tiles ahead (e4m3, 36 KB a stage):

    scoresᵀ (64 tokens, 16 heads) = tile · q8ᵀ            fp8 x fp8, q quantised to e4m3 with
                                                          a scale a head by the program, as
                                                          ``quantise_rows`` does
    outᵀ (512, 16 heads)         += Vᵀ · pᵀ               Vᵀ widened to fp16 in registers
                                                          (the product's A operand), p fp16

The value operand comes from the stage in 16-byte loads: a thread reads 16 latent columns of 16
tokens, exactly the elements its A fragments hold once the rows of outᵀ are ordered so: row
``r = 64 j + 16 w + 8 h + g`` (j the MMA's M repetition, w the warp, g the lane's group, h its
upper half) holds latent column ``128 w + 16 g + 2 j + h``. With that order the loaded bytes
need only pairing across two tokens (one ``prmt`` per four) and PTX's e4m3x2 -> f16x2
conversion (``_widen_pairs``); reshapes and permutes relabel them as the operand, no data
moves. The rows go back to column order once, through shared memory, before the output
stores. (The first form left the byte packing to the compiler, about five instructions a
pair, and stored the rows in the permuted order, 4-byte stores 64 bytes apart: 64 x 32K
0.406 ms, 8 x 4K 0.045, against this form's 0.335 / 0.027.)

Tile i + 1's scores are issued behind tile i's value product, and its operand widens under
them. Scale columns multiply the scores (the token's scale x the head's x softmax scale) and
p (the token's); a tile's scales come by TMA with it, a 256-byte row on the stage's barrier
(they were a block-table and a scale load a tile, in the loop: 64 x 32K 0.3164 -> 0.3073 ms
a layer, 16 x 128K 0.3207 -> 0.3126, 64 x 4K 0.0506 -> 0.0497 with the launch changes,
``decode_pdl_scales.json``). The refills take their pages from the split's page ids, staged in
shared memory before the loop (``_stage_pages``): a block-table load on each refill's path
held the TMA copy (64 x 32K 0.3108 -> 0.2989 ms a layer, 16 x 128K 0.3128 -> 0.3030, 64 x 4K
0.0492 -> 0.0487, ``decode_page_ids.json``). A split's last partial tile zeroes its
operand's columns past the range (a page's unused rows may hold NaN). Two programs an SM (84 KB of shared memory, 255
registers).
Each program quantises its request's q rows itself (the same operations as ``quantise_rows``,
which ``query_as_read`` runs for references) instead of a launch before: 64 x 4K 0.0661 ->
0.0636 ms, 8 x 4K 0.0266 -> 0.0259, 64 x 32K 0.344 either way
(``decode_tokens_fp8_query_in_kernel.json``); its q loads are issued ahead of the first
tiles' copies (``_query_rows``; after them they queued behind every program's copies: 6.3 us
from a program's start to its quantised q at 64 x 4K; 128 x 1K 0.0370 -> 0.0361 ms a layer,
8 x 4K 0.0194 -> 0.0183, ``decode_query_first.json``). The rows go back in column order as
``_finish`` converts them for 16-byte stores (``decode_store_layout.json``).

H200, a layer (``decode_tokens_fp8_regs.json``; the fp16-widened tile's form, then bf16, same
run): 64 x 32K 0.759 -> 0.328 ms (bf16 0.546: 1.67x its tokens a second, 88% of copy),
16 x 128K 0.759 -> 0.332, 64 x 4K 0.118 -> 0.066 (bf16 0.078), 128 x 1K 0.076 -> 0.052
(0.045), 8 x 4K 0.030 -> 0.027 (0.016). Each tile's products in turn measured within 3%.
"""

from __future__ import annotations

import torch

from splash.kernels_triton import mla_decode_gluon_tiles as tiles
from splash.kernels_triton.pdl import pdl

try:  # Gluon ships with Triton 3.5 and later
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from splash.kernels_triton.mla_decode_gluon_tiles import (
        _page_buffer,
        _pdl_trigger,
        _plan_item,
        _quantised_query,
        _query_buffers,
        _query_rows,
        _refill,
        _stage_pages,
        _start_copies,
        _tile_scales,
    )
    from splash.kernels_triton.mla_decode_tokens_gluon import (
        _finish,
        _normalised,
        _softmax_columns,
    )
except ImportError:  # pragma: no cover - an older Triton: the Triton kernels serve
    gluon = None


if gluon is not None:
    BN = gl.constexpr(tiles.BN)

    @gluon.jit
    def _widen_pairs(even, odd):
        """Two tokens' e4m3 bytes (4 columns of each, a register each) as fp16 pairs (a
        column's two tokens a register): out0 holds columns c, c + 1, out1 c + 2, c + 3."""
        return gl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t0, t1;
            .reg .b16 l0, h0, l1, h1;
            prmt.b32 t0, $4, $5, 0x5140;
            prmt.b32 t1, $4, $5, 0x7362;
            mov.b32 {l0, h0}, t0;
            mov.b32 {l1, h1}, t1;
            cvt.rn.f16x2.e4m3x2 $0, l0;
            cvt.rn.f16x2.e4m3x2 $1, h0;
            cvt.rn.f16x2.e4m3x2 $2, l1;
            cvt.rn.f16x2.e4m3x2 $3, h1;
            }""",
            constraints="=r,=r,=r,=r,r,r", args=[even, odd], dtype=(gl.float16, gl.float16),
            is_pure=True, pack=4)

    @gluon.jit
    def _widened(x):
        """e4m3 bytes ``x`` (tokens x columns; a thread's columns four a register, its tokens
        in pairs) as fp16 in the same (token, column) order: a byte permute for two tokens'
        four columns and PTX's conversions (``_widen_pairs``); the reshapes and permutes
        relabel the registers, no data moves."""
        T: gl.constexpr = x.shape[0]
        C: gl.constexpr = x.shape[1]
        even, odd = gl.split(gl.permute(gl.reshape(x, [T // 2, 2, C]), (0, 2, 1)))
        lo, hi = _widen_pairs(even, odd)
        # lo / hi at (pair e, column 4 a + 2 b + i): column 4 a + 2 (0 / 1) + b, token 2 e + i
        y = gl.reshape(gl.join(lo, hi), [T // 2, C // 4, 2, 2, 2])  # (e, a, b, i, lo/hi)
        return gl.reshape(gl.permute(y, (0, 3, 1, 4, 2)), [T, C])  # (token, column)

    @gluon.jit
    def _values_operand(kn, valid, a_layout: gl.constexpr, MASK: gl.constexpr):
        """The tile's value columns (BN tokens x 512, e4m3 in shared memory) as the value
        product's A operand Vᵀ (512 rows in the module's order x BN tokens), fp16 in
        registers; with ``MASK`` the tokens from ``valid`` on are 0."""
        # a thread's 16-byte rows: lanes (t, g) -> tokens 2t (+1, +8k), columns 16 g (+128 w)
        ld: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [1, 0], [8, 0], [16, 0], [32, 0]],
            lane_bases=[[2, 0], [4, 0], [0, 16], [0, 32], [0, 64]],
            warp_bases=[[0, 128], [0, 256]], block_bases=[], shape=[64, 512])
        y = _widened(kn.load(ld).to(gl.int8, bitcast=True))  # (token, column)
        # column 128 w + 16 g + 2 j + h -> row 64 j + 16 w + 8 h + g
        y = gl.reshape(y, [64, 4, 8, 8, 2])  # (token, w, g, j, h)
        y = gl.permute(y, (3, 1, 4, 2, 0))  # (j, w, h, g, token)
        v = gl.convert_layout(gl.reshape(y, [512, 64]), a_layout, assert_trivial=True)
        if MASK:
            tok = gl.arange(0, 64, layout=gl.SliceLayout(0, a_layout))
            v = gl.where((tok < valid)[None, :], v, gl.zeros_like(v))
        return v

    @gluon.jit
    def _issue_scores(qn_s, qr_s, kn_s, kr_s, bars, s0, i):
        """Tile i's scores (stage i % 2, fp8 x fp8) issued once its copy has landed."""
        st = i % 2
        mbarrier.wait(bars.index(st), (i // 2) & 1)
        tok = warpgroup_mma(kn_s.index(st), qn_s.permute((1, 0)), s0, use_acc=False,
                            is_async=True)
        return warpgroup_mma(kr_s.index(st), qr_s.permute((1, 0)), tok, is_async=True)

    @gluon.jit
    def _operand(kn, ks_s, t0, end, rows_m, a_layout: gl.constexpr):
        """The tile at ``t0``'s value operand (``_values_operand``; a partial tile's rows past
        ``end`` as 0), its tokens' scales (``_tile_scales``) and which of its rows hold a
        token."""
        ks, ok = _tile_scales(ks_s, t0, end, rows_m)
        if t0 + BN > end:
            v = _values_operand(kn, end - t0, a_layout, True)
        else:
            v = _values_operand(kn, end - t0, a_layout, False)
        return v, ks, ok

    @gluon.jit
    def _mla_decode_fp8_tokens_kernel(
        kn_desc, kr_desc,  # TMA: kv (pages * PS, L + R)
        ks_desc,  # TMA: the scales (pages, PS) fp32, a tile's row
        bt_ptr,  # (N, max_pages) int
        o_ptr, o_low_ptr, lse_ptr, out_ptr, lse_out_ptr, plan_ptr,  # as the tokens kernels'
        q_ptr, stride_qn, stride_qh,  # q (N, H, L + R), 16-bit, quantised here
        qk_scale, H, N,
        stride_btn, stride_btp,
        stride_os, stride_oh,
        stride_ls,
        stride_outn, stride_outh,
        stride_lon,
        L: gl.constexpr, R: gl.constexpr, PS: gl.constexpr, BH: gl.constexpr,
        LOW_SPLITS: gl.constexpr, num_warps: gl.constexpr,
    ):
        pid = gl.program_id(0)
        n, count, start, end = _plan_item(plan_ptr, pid, N, 1, 0, 0, False)
        if n < N:
            mma_s: gl.constexpr = gl.NVMMADistributedLayout(  # fp8: an MMA's K is 32
                version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BH, 32])
            mma: gl.constexpr = gl.NVMMADistributedLayout(
                version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BH, 16])
            a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma,
                                                         k_width=2)
            qn_s, qr_s = _query_buffers(BH, L, R)
            kn_s = gl.allocate_shared_memory(kn_desc.dtype, [2, BN, L], kn_desc.layout)
            kr_s = gl.allocate_shared_memory(kr_desc.dtype, [2, BN, R], kr_desc.layout)
            ks_s = gl.allocate_shared_memory(gl.float32, [2, 1, BN], ks_desc.layout)
            p_s = gl.allocate_shared_memory(
                gl.float16, [BN, BH], gl.NVMMASharedLayout.get_default_for([BN, BH], gl.float16))
            bars = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
            pages = _page_buffer()
            bt_row = bt_ptr + n.to(gl.int64) * stride_btn
            tiles = (end - start + BN - 1) // BN
            xn, xr = _query_rows(q_ptr + n.to(gl.int64) * stride_qn, stride_qh, H, L, R, BH,
                                 num_warps)
            _start_copies(None, None, kn_desc, kr_desc, ks_desc, n * H, bt_row, stride_btp,
                          start, tiles, qn_s, qr_s, kn_s, kr_s, ks_s, bars, bt_ptr, 0, 0, end, L,
                          PS, False, num_warps)
            _stage_pages(bt_row, stride_btp, start, end, pages, PS, num_warps)
            qs = _quantised_query(xn, xr, qn_s, qr_s, L, R, num_warps)
            qsc = gl.convert_layout(qs, gl.SliceLayout(0, mma)) * qk_scale

            acc = gl.zeros((L, BH), gl.float32, layout=mma)  # outᵀ, rows in the module's order
            m_i = gl.full((BH,), float("-inf"), gl.float32, layout=gl.SliceLayout(0, mma))
            l_i = gl.zeros((BH,), gl.float32, layout=gl.SliceLayout(0, mma))
            rows_m = gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
            s0 = gl.zeros((BN, BH), gl.float32, layout=mma_s)
            s = s0
            v = gl.zeros((L, BN), gl.float16, layout=a_layout)
            ks = gl.zeros((BN,), gl.float32, layout=gl.SliceLayout(1, mma))
            ok = rows_m < 0
            if tiles > 0:  # tile 0's scores and operand
                s_tok = _issue_scores(qn_s, qr_s, kn_s, kr_s, bars, s0, 0)
                v, ks, ok = _operand(kn_s.index(0), ks_s.index(0), start, end, rows_m, a_layout)
                s = warpgroup_mma_wait(0, deps=(s_tok,))
                _refill(kn_desc, kr_desc, ks_desc, bt_row, stride_btp, start + 2 * BN, end,
                        kn_s.index(0), kr_s.index(0), ks_s.index(0), bars.index(0), 2 < tiles,
                        bt_ptr, 0, 0, L, PS, False, num_warps, pages, start)
            for i in range(tiles):  # s, v, ks, ok: tile i's
                t0 = start + i * BN
                sm = gl.convert_layout(s, mma, assert_trivial=True)
                sm = gl.where(ok[:, None], sm * ks[:, None] * qsc[None, :], float("-inf"))
                p, alpha, m_i, l_i = _softmax_columns(sm, m_i, l_i, False)
                p_s.store((p * ks[:, None]).to(gl.float16))
                fence_async_shared()
                acc_tok = warpgroup_mma(v, p_s, acc * alpha[None, :], is_async=True)
                if i + 1 < tiles:  # tile i + 1's scores behind this tile's values
                    s_tok = _issue_scores(qn_s, qr_s, kn_s, kr_s, bars, s0, i + 1)
                    acc = warpgroup_mma_wait(1, deps=(acc_tok,))  # v is free
                    st = (i + 1) % 2
                    v, ks, ok = _operand(kn_s.index(st), ks_s.index(st), t0 + BN, end, rows_m,
                                         a_layout)
                    s = warpgroup_mma_wait(0, deps=(s_tok,))
                    # the stage is read (the scores' product, the operand's loads): refill it
                    _refill(kn_desc, kr_desc, ks_desc, bt_row, stride_btp, t0 + 3 * BN, end,
                            kn_s.index(st), kr_s.index(st), ks_s.index(st), bars.index(st),
                            i + 3 < tiles, bt_ptr, 0, 0, L, PS, False, num_warps, pages,
                            start)
                else:
                    acc = warpgroup_mma_wait(0, deps=(acc_tok,))
            for i in gl.static_range(3):
                mbarrier.invalidate(bars.index(i))
            _pdl_trigger()  # the merge may launch: only the stores are left
            res, lse = _normalised(acc, m_i, l_i)
            # rows back in column order (relabelled here; _finish's stores convert them once)
            res = gl.reshape(gl.permute(gl.reshape(res, [8, 4, 2, 8, BH]), (1, 3, 0, 2, 4)),
                             [L, BH])  # (w, g, j, h)
            _finish(res, lse, n, pid, count, H, o_ptr, o_low_ptr, lse_ptr, out_ptr,
                    lse_out_ptr, stride_os, stride_oh, stride_ls, stride_outn, stride_outh,
                    stride_lon, L, BH, LOW_SPLITS, mma, num_warps)


def launch(q: torch.Tensor, kv: torch.Tensor, scale: torch.Tensor, block_table: torch.Tensor,
           o_part: torch.Tensor, o_low: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor,
           lse: torch.Tensor, items: torch.Tensor, qk_scale: float, low: int) -> None:
    """One program per plan item (``mla_decode``'s balanced plan), each quantising its
    request's q to e4m3 with a scale a head."""
    N, H, D = q.shape
    L = out.shape[2]
    q = q if q.stride(2) == 1 else q.contiguous()
    rows_kv = tiles.kv_rows(kv)
    _mla_decode_fp8_tokens_kernel[(items.shape[0],)](
        tiles.descriptor(rows_kv, L), tiles.descriptor(rows_kv, D - L),
        tiles.scale_descriptor(scale), block_table, o_part, o_low, lse_part, out, lse, items,
        q, q.stride(0), q.stride(1), qk_scale, H, N, block_table.stride(0), block_table.stride(1),
        o_part.stride(0), o_part.stride(2), lse_part.stride(0), out.stride(0), out.stride(1),
        lse.stride(0), L=L, R=D - L, PS=kv.shape[1], BH=16, LOW_SPLITS=low, num_warps=4,
        launch_pdl=pdl(q.device),
    )
