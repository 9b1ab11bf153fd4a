"""MLA decode for many heads over an e4m3 cache on Hopper, in Gluon: the value product turned
around (``outᵀ = Vᵀ · pᵀ``) so that the fp8 tile feeds both products as it landed, with no
widened copy of it in shared memory (``config["fp8_register_values"]``, the CUDA default
above 32 heads; q read in e4m3, ``config["fp8_query"]``).

A program of two warpgroups holds 64 heads of one request over one split of the balanced
plan. Per 64-token tile, staged by TMA two tiles ahead (e4m3, 36 KB a stage):

    scoresᵀ (64 tokens, 64 heads) = tile · q8ᵀ     fp8 x fp8, each warpgroup 32 of the heads;
                                                   q quantised to e4m3 with a scale a head
    outᵀ    (512, 64 heads)      += Vᵀ · pᵀ         each warpgroup 256 of the latent rows: Vᵀ
                                                   widened to fp16 in registers (the product's
                                                   A operand), pᵀ fp16 in shared memory

The softmax runs down each head's column of tokens inside the warpgroup that scored it; p
(times the rows' scales) goes to shared memory, where both warpgroups' value products read all
64 heads (p double-buffered: one barrier a tile, after its stores). The value operand comes
from the stage in 8-byte loads: a thread reads 8 latent columns of its tokens, exactly the
elements its A fragments hold once the rows of outᵀ are ordered so: row
``r = 128 j + 16 w + 8 h + g`` (j the MMA's M repetition, w the warp of eight, g the lane's
group, h its upper half) holds latent column ``64 w + 8 g + 2 j + h``. The bytes then need only
pairing across two tokens and PTX's e4m3x2 -> f16x2 conversion (``_widened`` of the
few-head fp8 kernel, whose module explains the relabelling). The rows go back to column order
once, through shared memory, before the output stores.

The accumulator takes 128 of a thread's registers, so the operand is widened a quarter tile
(16 tokens) at a time, each quarter while the one before is multiplied; tile i + 1's scores
are issued among tile i's quarters. A split's last partial tile zeroes its operand's columns
past the range (a page's unused rows may hold NaN). H200, a layer against the widened-tile
kernel (``mla_decode_heads_gluon``) and bf16 in the same run (``decode_heads_fp8_registers.json``):
64 x 4K 0.269 -> 0.225 ms (bf16 0.181), 64 x 32K 1.93 -> 1.52 (1.35), 8 x 32K 0.264 -> 0.234
(0.180), 128 x 1K 0.158 -> 0.147 (0.106). The whole tile's operand at once spilled (0.32 ms at
64 x 4K), halves made ptxas serialise every wgmma for want of registers (0.234); 32-head
groups fit without spills but lose (0.28). Later tries, all correct and all slower
(``decode_heads_fp8_tried_s29.json``): the next tile's softmax under this tile's last quarter
(+10%), a lazy rescale (+1%), each quarter's operand widened before the wait (+20%), the scales
by TMA with the tile (+5%), and the value product in e4m3 too (p scaled to e4m3, Vᵀ an fp8
register operand from a 4 x 4 byte transpose: +10%, 35% more instructions). Nsight Compute puts
the tensor pipe at 26% busy and issue at 28%: a latency chain at one program an SM, the
products idle while both warpgroups run the softmax.
"""

from __future__ import annotations

import torch

from splash.kernels_triton import mla_decode_gluon_tiles as tiles
from splash.kernels_triton.kv_cache_ops import quantise_rows

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
        _plan_item,
        _refill,
        _start_copies,
        _tile_rows,
    )
    from splash.kernels_triton.mla_decode_tokens_fp8 import _issue_scores, _widened
    from splash.kernels_triton.mla_decode_tokens_gluon import _finish, _softmax_columns
except ImportError:  # pragma: no cover - an older Triton: the Triton kernels serve
    gluon = None

BH = 64  # heads a program


if gluon is not None:
    BN = gl.constexpr(tiles.BN)
    GH = gl.constexpr(BH)

    @gluon.jit
    def _values_quarter(kn, t_lo: gl.constexpr, valid, a_layout: gl.constexpr,
                        MASK: gl.constexpr):
        """Tokens [t_lo, t_lo + 16) of the tile's value columns (e4m3 in shared memory) as
        the value product's A operand Vᵀ (512 rows in the module's order x 16 tokens, both
        warpgroups' rows), fp16 in registers; with ``MASK`` the tile's tokens from ``valid``
        on are 0."""
        # a thread's 8-byte rows: lanes (t, g) -> tokens 2t (+1, +8), columns 8 g (+64 w)
        ld: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [0, 4], [1, 0], [8, 0]],
            lane_bases=[[2, 0], [4, 0], [0, 8], [0, 16], [0, 32]],
            warp_bases=[[0, 64], [0, 128], [0, 256]], block_bases=[], shape=[16, 512])
        y = _widened(kn.slice(t_lo, 16, dim=0).load(ld).to(gl.int8, bitcast=True))
        # column 64 w + 8 g + 2 j + h -> row 128 j + 16 w + 8 h + g
        y = gl.reshape(y, [16, 8, 8, 4, 2])  # (token, w, g, j, h)
        y = gl.permute(y, (3, 1, 4, 2, 0))  # (j, w, h, g, token)
        v = gl.convert_layout(gl.reshape(y, [512, 16]), a_layout, assert_trivial=True)
        if MASK:
            tok = t_lo + gl.arange(0, 16, layout=gl.SliceLayout(0, a_layout))
            v = gl.where((tok < valid)[None, :], v, gl.zeros_like(v))
        return v

    @gluon.jit
    def _values(kn, pb, acc, valid, a_layout: gl.constexpr, T_LO: gl.constexpr):
        """The value product of the tile's tokens [T_LO, T_LO + 16), issued (a partial tile's
        tokens past ``valid`` as 0)."""
        if valid < BN:
            v = _values_quarter(kn, T_LO, valid, a_layout, True)
        else:
            v = _values_quarter(kn, T_LO, valid, a_layout, False)
        return warpgroup_mma(v, pb.slice(T_LO, 16, dim=0), acc, is_async=True)

    @gluon.jit
    def _mla_decode_fp8_heads_kernel(
        qn_desc, qr_desc, kn_desc, kr_desc,  # TMA: q8 (N * H, L + R), kv (pages * PS, L + R)
        scale_ptr,  # (pages, PS) fp32
        qscale_ptr,  # (N * H,) fp32: q8's scales
        bt_ptr,  # (N, max_pages) int
        o_ptr, o_low_ptr, lse_ptr, out_ptr, lse_out_ptr, plan_ptr,  # as the tokens kernels'
        qk_scale, H, N,
        stride_sp, stride_ss,
        stride_btn, stride_btp,
        stride_os, stride_oh,
        stride_ls,
        stride_outn, stride_outh,
        stride_lon,
        L: gl.constexpr, R: gl.constexpr, PS: gl.constexpr, LOW_SPLITS: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        hg = gl.program_id(0)
        pid = gl.program_id(1)
        n, count, start, end = _plan_item(plan_ptr, pid, N, 1, 0, 0, False)
        if n < N:
            mma_s: gl.constexpr = gl.NVMMADistributedLayout(  # fp8: an MMA's K is 32
                version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, GH // 2, 32])
            mma: gl.constexpr = gl.NVMMADistributedLayout(
                version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, GH, 16])
            a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma,
                                                         k_width=2)
            qn_s = gl.allocate_shared_memory(qn_desc.dtype, [GH, L], qn_desc.layout)
            qr_s = gl.allocate_shared_memory(qr_desc.dtype, [GH, R], qr_desc.layout)
            kn_s = gl.allocate_shared_memory(kn_desc.dtype, [2, BN, L], kn_desc.layout)
            kr_s = gl.allocate_shared_memory(kr_desc.dtype, [2, BN, R], kr_desc.layout)
            p_s = gl.allocate_shared_memory(
                gl.float16, [2, BN, GH],
                gl.NVMMASharedLayout.get_default_for([BN, GH], gl.float16))
            bars = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
            bt_row = bt_ptr + n.to(gl.int64) * stride_btn
            h0 = hg * GH
            tiles = (end - start + BN - 1) // BN
            _start_copies(qn_desc, qr_desc, kn_desc, kr_desc, n * H + h0, bt_row, stride_btp,
                          start, tiles, qn_s, qr_s, kn_s, kr_s, bars, bt_ptr, 0, 0, end, L,
                          PS, False, num_warps)
            hs = h0 + gl.arange(0, GH, layout=gl.SliceLayout(0, mma_s))
            qsc = gl.load(qscale_ptr + n * H + hs, mask=hs < H, other=0.0) * qk_scale
            mbarrier.wait(bars.index(2), 0)

            acc = gl.zeros((L, GH), gl.float32, layout=mma)  # outᵀ, rows in the module's order
            m_i = gl.full((GH,), float("-inf"), gl.float32, layout=gl.SliceLayout(0, mma_s))
            l_i = gl.zeros((GH,), gl.float32, layout=gl.SliceLayout(0, mma_s))
            rows_m = gl.arange(0, BN, layout=gl.SliceLayout(1, mma_s))
            s = gl.zeros((BN, GH), gl.float32, layout=mma_s)
            ks = gl.zeros((BN,), gl.float32, layout=gl.SliceLayout(1, mma_s))
            ok = rows_m < 0
            if tiles > 0:  # tile 0's scores
                s = warpgroup_mma_wait(0, deps=(_issue_scores(qn_s, qr_s, kn_s, kr_s, bars, s,
                                                              0),))
                off, ok = _tile_rows(bt_row, stride_btp, start, end, rows_m, stride_sp,
                                     stride_ss, PS, False)
                ks = gl.load(scale_ptr + off, mask=ok, other=0.0)
            for i in range(tiles):  # s, ks, ok: tile i's
                st = i % 2
                t0 = start + i * BN
                kn = kn_s.index(st)
                sm = gl.where(ok[:, None], s * ks[:, None] * qsc[None, :], float("-inf"))
                p, alpha, m_i, l_i = _softmax_columns(sm, m_i, l_i, False)
                pb = p_s.index(st)
                pb.store((p * ks[:, None]).to(gl.float16))
                fence_async_shared()
                gl.thread_barrier()  # both warpgroups' heads are in
                alpha_o = gl.convert_layout(alpha, gl.SliceLayout(0, mma))
                # the value product a quarter of the tokens at a time: one quarter's operand
                # widening while the one before is multiplied
                acc_tok = _values(kn, pb, acc * alpha_o[None, :], end - t0, a_layout, 0)
                if i + 1 < tiles:
                    acc = warpgroup_mma_wait(0, deps=(acc_tok,))
                    acc_tok = _values(kn, pb, acc, end - t0, a_layout, 16)
                    # tile i + 1's scores among the quarters (into tile i's spent registers)
                    s_tok = _issue_scores(qn_s, qr_s, kn_s, kr_s, bars, s, i + 1)
                    for qt in gl.static_range(2, 4):
                        acc = warpgroup_mma_wait(1, deps=(acc_tok,))
                        acc_tok = _values(kn, pb, acc, end - t0, a_layout, 16 * qt)
                    s = warpgroup_mma_wait(1, deps=(s_tok,))
                    off, ok = _tile_rows(bt_row, stride_btp, t0 + BN, end, rows_m, stride_sp,
                                         stride_ss, PS, False)
                    ks = gl.load(scale_ptr + off, mask=ok, other=0.0)
                    # this tile's stage is read (scores, operands): refill it
                    _refill(kn_desc, kr_desc, bt_row, stride_btp, t0 + 2 * BN, end, kn,
                            kr_s.index(st), bars.index(st), i + 2 < tiles, bt_ptr, 0, 0, L, PS,
                            False, num_warps)
                else:
                    for qt in gl.static_range(1, 4):
                        acc = warpgroup_mma_wait(0, deps=(acc_tok,))
                        acc_tok = _values(kn, pb, acc, end - t0, a_layout, 16 * qt)
                acc = warpgroup_mma_wait(0, deps=(acc_tok,))
            for i in gl.static_range(3):
                mbarrier.invalidate(bars.index(i))
            # rows back in column order (through shared memory, once): coalesced stores
            acc = gl.permute(gl.reshape(acc, [4, 8, 2, 8, GH]), (1, 3, 0, 2, 4))  # (w, g, j, h)
            acc = gl.convert_layout(gl.reshape(acc, [L, GH]), mma)
            m_o = gl.convert_layout(m_i, gl.SliceLayout(0, mma))
            l_o = gl.convert_layout(l_i, gl.SliceLayout(0, mma))
            _finish(acc, m_o, l_o, n, pid, count, H - h0, o_ptr + h0 * stride_oh,
                    o_low_ptr + h0 * stride_oh, lse_ptr + h0, out_ptr + h0 * stride_outh,
                    lse_out_ptr + h0, stride_os, stride_oh, stride_ls, stride_outn,
                    stride_outh, stride_lon, L, GH, LOW_SPLITS, mma)


def serves(kv: torch.Tensor, cfg: dict) -> bool:
    """Whether this kernel takes an e4m3 cache where the many-head Gluon kernel would
    (``mla_decode_heads_gluon.usable``, q read in e4m3): ``config["fp8_register_values"]``."""
    return gluon is not None and kv.dtype == torch.float8_e4m3fn \
        and bool(cfg.get("fp8_query")) and bool(cfg.get("fp8_register_values"))


def launch(q: torch.Tensor, kv: torch.Tensor, scale: torch.Tensor, block_table: torch.Tensor,
           o_part: torch.Tensor, o_low: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor,
           lse: torch.Tensor, items: torch.Tensor, qk_scale: float, low: int) -> None:
    """Head groups of 64 x one program per plan item (``mla_decode``'s balanced plan), q
    quantised to e4m3 with a scale a head first."""
    N, H, D = q.shape
    L = out.shape[2]
    q8, q_scale = quantise_rows(q.reshape(N * H, D), kv.dtype)
    rows_q, rows_kv = tiles.tma_rows(q8.view(N, H, D), kv)
    _mla_decode_fp8_heads_kernel[((H + BH - 1) // BH, items.shape[0])](
        tiles.descriptor(rows_q, L), tiles.descriptor(rows_q, D - L),
        tiles.descriptor(rows_kv, L), tiles.descriptor(rows_kv, D - L),
        scale, q_scale, block_table, o_part, o_low, lse_part, out, lse, items, qk_scale, H, N,
        scale.stride(0), scale.stride(1), block_table.stride(0), block_table.stride(1),
        o_part.stride(0), o_part.stride(2), lse_part.stride(0), out.stride(0), out.stride(1),
        lse.stride(0), L=L, R=D - L, PS=kv.shape[1], LOW_SPLITS=low, num_warps=8,
    )
