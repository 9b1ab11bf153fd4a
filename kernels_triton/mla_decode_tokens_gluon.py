"""MLA decode for few heads on Hopper, written in Gluon (Triton's layout-explicit dialect):
the balanced plan's programs with the tokens on the MMA's M side (``config["gluon"]``, the
CUDA default at 16 heads or fewer on sm_90). Per 64-token tile (one page of 64 or more):

    scoresᵀ (64 tokens, 16 heads) = tile · qᵀ                 (q in shared memory)
    outᵀ (512, 16 heads)         += tile[:, :512]ᵀ · pᵀ      (the tile's transposed view; p in
                                                             shared memory)

so no operand pads 16 heads to the MMA's 64 rows. Two forms:
- 16-bit KV (``_mla_decode_tokens_tma_kernel``): the query and two stages of tiles (72 KB
  each) come in by TMA, a page's rows a copy; one program (one warpgroup) an SM, 168 KB of
  shared memory, 168 registers; the next tile's copy runs under this tile's products. A
  split's last partial tile zeroes its rows past the range (a page's unused rows may hold
  NaN). H200, a layer against the Triton kernel (``decode_tokens_gluon.json``): 64 x 4K
  0.0815 -> 0.0792 ms, 8 x 4K 0.0217 -> 0.0159, one 128K request among 63 of 1K 0.089 ->
  0.076; 64 requests over 1K-32K 0.352 -> 0.370 and 128 over 256-2K 0.059 -> 0.064 (with
  one program an SM, splits of unequal length leave SMs idle; two programs an SM, a second
  wave, lose the uniform batches instead).
- fp8 KV with q kept in 16 bits (``_mla_decode_fp8_gluon_kernel``; ``fp8_query: False``,
  and sparse gathers; the default reads q in e4m3, ``mla_decode_tokens_fp8``, 2.3x faster at
  64 x 32K): a program loads the fp8 rows into registers,
  widens them to fp16 (rows past its range as 0) into one swizzled shared tile that both
  products read (the Triton kernels widen in registers and keep both chunks live: 255
  registers, one program an SM); 94 KB of shared memory lets two programs share an SM, whose
  load, widen and MMA phases interleave. Scale columns multiply the scores (fp8 scale x
  softmax scale) and p (the value rows' scale), as in ``mla_decode``. H200
  (``fp8_decode_gluon.json``): 64 x 32K 0.798 -> 0.746 ms, 64 x 1K 0.047 -> 0.041, 8 x 4K
  0.027 -> 0.030. Tried by the session that wrote it: the rows copied into an fp8 shared ring
  by cp.async first (205 KB, one program an SM: 0.846 ms at 64 x 32K), and the next tile's
  rows loaded into registers one tile ahead (2.3 KB of spills: 4.2 ms). Tried later: the
  16-bit form's TMA pipeline with e4m3 stages, each widened in shared memory into one fp16
  tile and refilled at once (2 or 3 stages, one program an SM): 64 x 32K 0.826 / 0.838 ms
  against this form's 0.751, as one program's serial chain takes ~3.3 us a tile
  (``decode_tokens_fp8_tma_tried.json``); this form's row offsets (no spills, 194
  registers) measured the same as its spilling predecessor
  (``decode_tokens_fp8_offsets.json``).

With ``GATHER`` both forms serve ``mla_sparse``: a split of one row's selected slots, the
16-bit form's rows gathered by cp.async into its stages, the fp8 form's loaded by slot
(``mla_decode_gluon_tiles``); at 16 rows x 2,048 slots both lose to the Triton kernel
(splits of four tiles; ``dsa_sparse_gluon.json``), which the tuning table keeps there.

The online softmax runs per head column (a reduction over the tile's tokens). Outputs follow
the plan as the Triton kernels' do: a request's only split writes the output, others write
partial rows (16-bit ones for requests of at most ``LOW_SPLITS`` splits) for ``lse_merge``.
"""

from __future__ import annotations

import torch

from splash.kernels_triton import _validate as V
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
        _pdl_trigger,
        _plan_item,
        _refill,
        _start_copies,
        _tile_rows,
        _wait_tile,
        _zero_rows_past,
    )
except ImportError:  # pragma: no cover - an older Triton: the Triton kernels serve
    gluon = None

TILE = tiles.BN  # tokens a tile (the scores product's M)


def usable(q: torch.Tensor, kv: torch.Tensor, L: int, R: int, page_size: int,
           cfg: dict) -> bool:
    """Whether ``config["gluon"]`` applies: at most 16 heads, KV of DeepSeek's dims (L 512,
    R 64) in pages of a multiple of 64 tokens, compiled on an NVIDIA sm_90 GPU; e4m3 KV
    (the widening kernel), or 16-bit KV of q's dtype in pages laid end to end (TMA)."""
    if not (bool(cfg.get("gluon")) and gluon is not None and V.compiled_hopper(q)
            and q.shape[1] <= 16 and (L, R) == (512, 64) and page_size % TILE == 0
            and cfg.get("BLOCK_N") == TILE and kv.stride(2) == 1):
        return False
    if kv.dtype == torch.float8_e4m3fn:
        return True
    return kv.dtype == q.dtype and kv.dtype in (torch.bfloat16, torch.float16) \
        and kv.stride(0) == page_size * kv.stride(1) and kv.stride(1) % 8 == 0 \
        and kv.data_ptr() % 16 == 0


if gluon is not None:
    BN = gl.constexpr(TILE)
    CW = gl.constexpr(64)  # latent columns loaded and widened at a time
    _LOG2E = gl.constexpr(1.4426950408889634)

    @gluon.jit
    def _widen(k16, kv_ptr, off, ok_r, c: gl.constexpr, at: gl.constexpr, ld: gl.constexpr):
        """Column chunk ``c`` (CW wide) of the tile's fp8 rows (at offsets ``off``; 0 past
        ``ok_r``) widened to fp16 into chunk ``at`` of ``k16``."""
        cols = gl.arange(0, CW, layout=gl.SliceLayout(0, ld))
        rows = gl.load(kv_ptr + off[:, None] + (c * CW + cols)[None, :], mask=ok_r, other=0.0)
        k16.slice(at * CW, CW, dim=1).store(rows.to(gl.float16))

    @gluon.jit
    def _softmax_columns(s, m_i, l_i, MAYBE_EMPTY: gl.constexpr):
        """One tile's online-softmax step per head column of the scores ``s`` (tokens x
        heads, already scaled and masked): p, the accumulator's rescale, the running max and
        sum. ``MAYBE_EMPTY``: a tile may hold no token (its max -inf)."""
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        m_use = m_new
        if MAYBE_EMPTY:
            m_use = gl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - m_use[None, :])
        return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=0)

    @gluon.constexpr_function
    def _store_layout(rows, cols, num_warps):
        """outᵀ (latent columns x heads) for the output stores: a thread holds 8 consecutive
        latent columns of a head (16 bytes of a 16-bit output) and a warp's store covers 128
        columns of 2 heads; the MMA's layout instead wrote 2-byte pieces a row apart."""
        wr = min(num_warps, max(rows // 128, 1))
        return gl.BlockedLayout([8, 1], [16, 2], [wr, num_warps // wr], [0, 1])

    @gluon.jit
    def _normalised(acc, m_i, l_i):
        """outᵀ = acc / l (in acc's layout) and the heads' lse (in l's)."""
        has = l_i > 0.0
        l_safe = gl.where(has, l_i, 1.0)
        lse = gl.where(has, (m_i + gl.log2(l_safe)) / _LOG2E, float("-inf"))
        return acc / l_safe[None, :], lse

    @gluon.jit
    def _finish(res, lse, n, pid, count, H, o_ptr, o_low_ptr, lse_ptr, out_ptr,
                lse_out_ptr, stride_os, stride_oh, stride_ls, stride_outn, stride_outh,
                stride_lon, L: gl.constexpr, BH: gl.constexpr, LOW_SPLITS: gl.constexpr,
                mma: gl.constexpr, num_warps: gl.constexpr):
        """outᵀ ``res`` (L x BH, ``_normalised``; any layout) and its ``lse`` into the output
        (a request's only split) or the split's partial rows. 16-bit rows go out from
        ``_store_layout``'s (one pass through shared memory); fp32 partial rows from ``mma``
        (where 8-byte pieces fill a sector anyway: through the store layout they were slower,
        16 heads fp8 8 x 4K 0.0182 -> 0.0194 ms a layer)."""
        lay: gl.constexpr = _store_layout(L, BH, num_warps)
        oc = gl.arange(0, L, layout=gl.SliceLayout(1, lay))
        oh = gl.arange(0, BH, layout=gl.SliceLayout(0, lay))
        mask = (oh < H)[None, :]
        lh = gl.arange(0, BH, layout=gl.SliceLayout(0, mma))
        lse = gl.convert_layout(lse, gl.SliceLayout(0, mma))
        if count == 1:
            o = out_ptr + n.to(gl.int64) * stride_outn + oh[None, :] * stride_outh
            gl.store(o + oc[:, None], gl.convert_layout(res.to(out_ptr.dtype.element_ty), lay),
                     mask=mask)
            gl.store(lse_out_ptr + n * stride_lon + lh, lse, mask=lh < H)
        else:
            if count <= LOW_SPLITS:
                low = pid * stride_os + oh[None, :] * stride_oh + oc[:, None]
                gl.store(o_low_ptr + low,
                         gl.convert_layout(res.to(o_low_ptr.dtype.element_ty), lay), mask=mask)
            else:
                rc = gl.arange(0, L, layout=gl.SliceLayout(1, mma))
                full = pid * stride_os + lh[None, :] * stride_oh + rc[:, None]
                gl.store(o_ptr + full, gl.convert_layout(res, mma), mask=(lh < H)[None, :])
            gl.store(lse_ptr + pid * stride_ls + lh, lse, mask=lh < H)

    # splits stays a runtime int: one split a row compiled as a constant 1 trips an assertion
    # in Triton 3.6's lowering to LLVM
    @gluon.jit(do_not_specialize=["splits"])
    def _mla_decode_tokens_tma_kernel(
        qn_desc, qr_desc, kn_desc, kr_desc,  # TMA: q (N * H, L + R), kv (pages * PS, L + R)
        bt_ptr,  # (N, max_pages) int (GATHER: (N, K) slots)
        o_ptr, o_low_ptr, lse_ptr, out_ptr, lse_out_ptr, plan_ptr,  # as the fp8 kernel's
        kv_ptr,  # (pages, PS, L + R), read by GATHER
        qk_scale, H, N,
        splits, split_len, K,  # GATHER: each row's K slots in splits of split_len
        stride_btn, stride_btp,
        stride_kvp, stride_kvs,
        stride_os, stride_oh,
        stride_ls,
        stride_outn, stride_outh,
        stride_lon,
        L: gl.constexpr, R: gl.constexpr, PS: gl.constexpr, BH: gl.constexpr,
        LOW_SPLITS: gl.constexpr, GATHER: gl.constexpr, num_warps: gl.constexpr,
    ):
        pid = gl.program_id(0)
        n, count, start, end = _plan_item(plan_ptr, pid, N, splits, split_len, K, GATHER)
        if n < N:
            dtype: gl.constexpr = kn_desc.dtype
            mma: gl.constexpr = gl.NVMMADistributedLayout(
                version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BH, 16])
            qn_s = gl.allocate_shared_memory(dtype, [BH, L], qn_desc.layout)
            qr_s = gl.allocate_shared_memory(dtype, [BH, R], qr_desc.layout)
            kn_s = gl.allocate_shared_memory(dtype, [2, BN, L], kn_desc.layout)
            kr_s = gl.allocate_shared_memory(dtype, [2, BN, R], kr_desc.layout)
            p_s = gl.allocate_shared_memory(
                dtype, [BN, BH], gl.NVMMASharedLayout.get_default_for([BN, BH], dtype))
            bars = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
            bt_row = bt_ptr + n.to(gl.int64) * stride_btn
            tiles = (end - start + BN - 1) // BN
            _start_copies(qn_desc, qr_desc, kn_desc, kr_desc, None, n * H, bt_row, stride_btp,
                          start, tiles, qn_s, qr_s, kn_s, kr_s, None, bars, kv_ptr, stride_kvp,
                          stride_kvs, end, L, PS, GATHER, num_warps)
            mbarrier.wait(bars.index(2), 0)

            acc = gl.zeros((L, BH), gl.float32, layout=mma)  # outᵀ
            m_i = gl.full((BH,), float("-inf"), gl.float32, layout=gl.SliceLayout(0, mma))
            l_i = gl.zeros((BH,), gl.float32, layout=gl.SliceLayout(0, mma))
            rows_m = gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
            for i in range(tiles):
                st = i % 2
                t0 = start + i * BN
                kn = kn_s.index(st)
                _wait_tile(bars, st, (i // 2) & 1, 1, GATHER)
                if not GATHER:  # (gathered rows past the range are zeros)
                    if t0 + BN > end:  # the split's last, partial tile: its unused rows to 0
                        _zero_rows_past(kn, end - t0, L, num_warps)
                        fence_async_shared()
                        gl.thread_barrier()
                s = gl.zeros((BN, BH), gl.float32, layout=mma)
                s = warpgroup_mma(kn, qn_s.permute((1, 0)), s, use_acc=False, is_async=True)
                s = warpgroup_mma(kr_s.index(st), qr_s.permute((1, 0)), s, is_async=True)
                s = warpgroup_mma_wait(0, deps=(s,))
                ok = _tile_rows(bt_row, stride_btp, t0, end, rows_m, 0, 0, PS, GATHER)[1]
                s = gl.where(ok[:, None], s * qk_scale, float("-inf"))
                p, alpha, m_i, l_i = _softmax_columns(s, m_i, l_i, GATHER)
                p_s.store(p.to(dtype))
                fence_async_shared()
                acc = warpgroup_mma(kn.permute((1, 0)), p_s, acc * alpha[None, :],
                                    is_async=True)
                acc = warpgroup_mma_wait(0, deps=(acc,))
                # the value product has read this stage: refill it
                _refill(kn_desc, kr_desc, None, bt_row, stride_btp, t0 + 2 * BN, end, kn,
                        kr_s.index(st), None, bars.index(st), i + 2 < tiles, kv_ptr, stride_kvp,
                        stride_kvs, L, PS, GATHER, num_warps)
            for i in gl.static_range(3):
                mbarrier.invalidate(bars.index(i))
            _pdl_trigger()  # the merge may launch: only the stores are left
            res, lse = _normalised(acc, m_i, l_i)
            _finish(res, lse, n, pid, count, H, o_ptr, o_low_ptr, lse_ptr, out_ptr,
                    lse_out_ptr, stride_os, stride_oh, stride_ls, stride_outn, stride_outh,
                    stride_lon, L, BH, LOW_SPLITS, mma, num_warps)

    # splits stays a runtime int: one split a row compiled as a constant 1 trips an assertion
    # in Triton 3.6's lowering to LLVM
    @gluon.jit(do_not_specialize=["splits"])
    def _mla_decode_fp8_gluon_kernel(
        q_ptr,  # (N, H, L + R) fp16
        kv_ptr,  # (pages, PS, L + R) e4m3
        scale_ptr,  # (pages, PS) fp32
        bt_ptr,  # (N, max_pages) int
        o_ptr,  # (P, 1, H, L) fp32 partial rows
        o_low_ptr,  # (P, 1, H, L) 16-bit partial rows (o_ptr's strides)
        lse_ptr,  # (P, 1, H) fp32
        out_ptr,  # (N, H, L)
        lse_out_ptr,  # (N, H) fp32
        plan_ptr,  # (programs, 4) int32: request, splits, start, end
        qk_scale, H, N,
        splits, split_len, K,  # GATHER: each row's K slots (bt_ptr) in splits of split_len
        stride_qn, stride_qh,
        stride_kvp, stride_kvs,
        stride_sp, stride_ss,
        stride_btn, stride_btp,
        stride_os, stride_oh,
        stride_ls,
        stride_outn, stride_outh,
        stride_lon,
        L: gl.constexpr, R: gl.constexpr, PS: gl.constexpr, BH: gl.constexpr,
        LOW_SPLITS: gl.constexpr, GATHER: gl.constexpr, num_warps: gl.constexpr,
    ):
        pid = gl.program_id(0)
        n, count, start, end = _plan_item(plan_ptr, pid, N, splits, split_len, K, GATHER)
        if n < N:
            ld: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [num_warps, 1], [1, 0])
            mma: gl.constexpr = gl.NVMMADistributedLayout(
                version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BH, 16])
            k16 = gl.allocate_shared_memory(
                gl.float16, [BN, L], gl.NVMMASharedLayout.get_default_for([BN, L], gl.float16))
            k16r = gl.allocate_shared_memory(
                gl.float16, [BN, R], gl.NVMMASharedLayout.get_default_for([BN, R], gl.float16))
            p_s = gl.allocate_shared_memory(
                gl.float16, [BN, BH], gl.NVMMASharedLayout.get_default_for([BN, BH], gl.float16))
            ldq: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [num_warps, 1], [1, 0])
            qh = gl.arange(0, BH, layout=gl.SliceLayout(1, ldq))
            qc = gl.arange(0, L, layout=gl.SliceLayout(0, ldq))
            q_row = q_ptr + n.to(gl.int64) * stride_qn
            qn = gl.load(q_row + qh[:, None] * stride_qh + qc[None, :], mask=(qh < H)[:, None],
                         other=0.0)
            qn_s = gl.allocate_shared_memory(
                gl.float16, [BH, L], gl.NVMMASharedLayout.get_default_for([BH, L], gl.float16),
                qn)
            qhr = gl.arange(0, BH, layout=gl.SliceLayout(1, ld))
            qcr = gl.arange(0, R, layout=gl.SliceLayout(0, ld))
            qr = gl.load(q_row + qhr[:, None] * stride_qh + (L + qcr)[None, :],
                         mask=(qhr < H)[:, None], other=0.0)
            qr_s = gl.allocate_shared_memory(
                gl.float16, [BH, R], gl.NVMMASharedLayout.get_default_for([BH, R], gl.float16),
                qr)
            fence_async_shared()

            acc = gl.zeros((L, BH), gl.float32, layout=mma)  # outᵀ
            m_i = gl.full((BH,), float("-inf"), gl.float32, layout=gl.SliceLayout(0, mma))
            l_i = gl.zeros((BH,), gl.float32, layout=gl.SliceLayout(0, mma))
            rows_m = gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
            rows_l = gl.arange(0, BN, layout=gl.SliceLayout(1, ld))
            bt_row = bt_ptr + n.to(gl.int64) * stride_btn
            for t0 in range(start, end, BN):  # plan ranges start on tiles, tiles on pages
                off_m, ok_m = _tile_rows(bt_row, stride_btp, t0, end, rows_m, stride_sp,
                                         stride_ss, PS, GATHER)
                ks = gl.load(scale_ptr + off_m, mask=ok_m, other=0.0)
                off, ok_l = _tile_rows(bt_row, stride_btp, t0, end, rows_l, stride_kvp,
                                       stride_kvs, PS, GATHER)
                ok_r = ok_l[:, None]
                gl.thread_barrier()  # the last tile's value product has read the tile
                for c in gl.static_range(L // CW):
                    _widen(k16, kv_ptr, off, ok_r, c, c, ld)
                _widen(k16r, kv_ptr, off, ok_r, L // CW, 0, ld)
                fence_async_shared()
                s = gl.zeros((BN, BH), gl.float32, layout=mma)
                s = warpgroup_mma(k16, qn_s.permute((1, 0)), s, use_acc=False, is_async=True)
                s = warpgroup_mma(k16r, qr_s.permute((1, 0)), s, is_async=True)
                s = warpgroup_mma_wait(0, deps=(s,))
                s = gl.where(ok_m[:, None], s * (ks * qk_scale)[:, None], float("-inf"))
                p, alpha, m_i, l_i = _softmax_columns(s, m_i, l_i, True)
                p_s.store((p * ks[:, None]).to(gl.float16))
                fence_async_shared()
                acc = warpgroup_mma(k16.permute((1, 0)), p_s, acc * alpha[None, :],
                                    is_async=True)
                acc = warpgroup_mma_wait(0, deps=(acc,))
            _pdl_trigger()  # the merge may launch: only the stores are left
            res, lse = _normalised(acc, m_i, l_i)
            _finish(res, lse, n, pid, count, H, o_ptr, o_low_ptr, lse_ptr, out_ptr,
                    lse_out_ptr, stride_os, stride_oh, stride_ls, stride_outn, stride_outh,
                    stride_lon, L, BH, LOW_SPLITS, mma, num_warps)

def launch(q: torch.Tensor, kv: torch.Tensor, scale: torch.Tensor, block_table: torch.Tensor,
           o_part: torch.Tensor, o_low: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor,
           lse: torch.Tensor, items: torch.Tensor | None, qk_scale: float, low: int,
           sparse: tuple[int, int] | None = None) -> None:
    """One program per plan item (``_decode_plan_kernel``'s), the rest as the balanced Triton
    launch takes them. fp8 KV: fp16 products, q clamped to fp16's range. ``sparse`` as in
    ``mla_decode_heads_gluon.launch``."""
    N, H, D = q.shape
    L = out.shape[2]
    tail = (block_table.stride(0), block_table.stride(1), o_part.stride(0), o_part.stride(2),
            lse_part.stride(0), out.stride(0), out.stride(1), lse.stride(0))
    splits, split_len = sparse or (1, 0)
    programs = items.shape[0] if items is not None else splits * N
    if kv.dtype != torch.float8_e4m3fn:
        rows_q, rows_kv = tiles.tma_rows(q, kv)
        _mla_decode_tokens_tma_kernel[(programs,)](
            tiles.descriptor(rows_q, L, 16), tiles.descriptor(rows_q, D - L, 16),
            tiles.descriptor(rows_kv, L), tiles.descriptor(rows_kv, D - L),
            block_table, o_part, o_low, lse_part, out, lse,
            block_table if items is None else items, kv, qk_scale, H, N, splits, split_len,
            block_table.shape[1], tail[0], tail[1], kv.stride(0), kv.stride(1), *tail[2:],
            L=L, R=D - L, PS=kv.shape[1], BH=16, LOW_SPLITS=low, GATHER=sparse is not None,
            num_warps=4, launch_pdl=pdl(q.device),
        )
        return
    q16 = q if q.dtype == torch.float16 else q.float().clamp(-65504.0, 65504.0).half()
    _mla_decode_fp8_gluon_kernel[(programs,)](
        q16, kv, scale, block_table, o_part, o_low, lse_part, out, lse,
        block_table if items is None else items, qk_scale, H, N, splits, split_len,
        block_table.shape[1], q16.stride(0), q16.stride(1), kv.stride(0), kv.stride(1),
        scale.stride(0), scale.stride(1), *tail, L=L, R=D - L, PS=kv.shape[1], BH=16,
        LOW_SPLITS=low, GATHER=sparse is not None, num_warps=4, launch_pdl=pdl(q.device),
    )
