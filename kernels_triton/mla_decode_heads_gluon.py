"""MLA decode for many heads on Hopper, written in Gluon (Triton's layout-explicit dialect):
a program of two warpgroups holds 64 heads of one request over one split of the balanced
plan (``config["gluon"]``, the CUDA default on sm_90 at more than 32 heads), over 16-bit KV;
``mla_decode_heads_fp8_ws`` is its form over e4m3 KV.

The 64 heads' query (64 x 576, 72 KB) and the KV tiles (64 tokens x 576, 72 KB each, two
stages) come into shared memory by the bulk tensor copy engine (TMA), one page's 64 rows a
copy, so no register holds a tile on its way in and the next tile's copy runs under this
tile's products. Per tile:

    scores (64 heads, 64 tokens) = q · tileᵀ          (each warpgroup 32 of the tokens)
    acc    (64 heads, 512)      += p · tile[:, :512]  (each warpgroup 256 of the columns;
                                                      p from registers)

with the online softmax between them; the accumulator is 128 fp32 registers a thread, and
each thread keeps the sums of p for its own columns, reduced across the warpgroups once
after the last tile. The next tile's scores are issued with this tile's value product.
H200, a layer against the Triton kernel: 128 heads bf16 64 x 4K 0.264 -> 0.179 ms, 64 x 32K
2.003 -> 1.329 (439 TFLOP/s) (``decode_heads_gluon.json``, ``decode_heads_defer_sum.json``).

An e4m3 form of this kernel, each tile's value columns widened to fp16 in shared memory by
the warpgroups themselves between their products (64 x 32K 1.95 ms, 0.69x bf16's speed,
``decode_heads_fp8_scores.json``), is removed: the warp-specialised kernel, whose own warpgroup
widens beside the products, was 1.5-1.6x faster on an H100.

The last tile of a split zeroes its rows past the range in shared memory before the value
product (a page's unused rows may hold anything, NaN included, and 0 x NaN is NaN).
Outputs follow the plan as the Triton kernels' do: a request's only split writes the
output, the others partial rows (16-bit ones for requests of at most ``LOW_SPLITS``
splits) for ``lse_merge``. With ``GATHER`` the kernel serves ``mla_sparse`` instead: a
split of one row's selected slots, each tile's rows gathered by cp.async
(``mla_decode_gluon_tiles``): 128 heads bf16, 16 rows x 2,048 slots, 0.0519 -> 0.0418 ms
against the Triton kernel (``dsa_sparse_gluon.json``).
"""

from __future__ import annotations

import torch

from splash.kernels_triton import _validate as V
from splash.kernels_triton.mla_decode_gluon_tiles import BN, descriptor, tma_rows
from splash.kernels_triton.pdl import pdl

try:  # Gluon ships with Triton 3.5 and later
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )

    from splash.kernels_triton.mla_decode_gluon_tiles import (
        _plan_item,
        _refill,
        _start_copies,
        _tile_rows,
        _wait_tile,
        _zero_rows_past,
    )
except ImportError:  # pragma: no cover - an older Triton: the Triton kernels serve
    gluon = None

BH = 64  # heads a program (the MMA's M)


def usable(q: torch.Tensor, kv: torch.Tensor, L: int, R: int, page_size: int,
           cfg: dict) -> bool:
    """Whether ``config["gluon"]`` applies here: 16-bit KV of q's dtype, or e4m3 KV with a
    16-bit q read in e4m3 (``config["fp8_query"]``; ``mla_decode_heads_fp8_ws``'s kernel
    serves it), with DeepSeek's dims (L 512, R 64) in
    pages of a multiple of 64 tokens laid end to end, more than 32 heads, compiled on an
    NVIDIA sm_90 GPU."""
    kv_ok = q.dtype == kv.dtype if kv.dtype in (torch.bfloat16, torch.float16) else \
        kv.dtype == torch.float8_e4m3fn and q.dtype in (torch.bfloat16, torch.float16) \
        and bool(cfg.get("fp8_query"))
    return bool(cfg.get("gluon")) and gluon is not None and kv_ok and V.compiled_hopper(q) \
        and q.shape[1] > 32 and (L, R) == (512, 64) and page_size % BN == 0 \
        and kv.stride(2) == 1 and kv.stride(0) == page_size * kv.stride(1) \
        and kv.stride(1) * kv.element_size() % 16 == 0 and kv.data_ptr() % 16 == 0


if gluon is not None:
    GH = gl.constexpr(BH)
    GN = gl.constexpr(BN)

    @gluon.jit
    def _scores(qn_s, qr_s, kn, kr, s):
        """q · tileᵀ (both parts), issued; ``s`` gives the accumulator's layout."""
        tok = warpgroup_mma(qn_s, kn.permute((1, 0)), s, use_acc=False, is_async=True)
        return warpgroup_mma(qr_s, kr.permute((1, 0)), tok, is_async=True)

    @gluon.jit
    def _next_scores(qn_s, qr_s, kn_s, kr_s, bars, s, i, nxt, PENDING: gl.constexpr,
                     GATHER: gl.constexpr):
        """Tile i + 1's scores, issued once its copy has landed (``PENDING``: the tile copies
        issued after it); ``s`` as is past the last."""
        if nxt:
            st = (i + 1) % 2
            _wait_tile(bars, st, ((i + 1) // 2) & 1, PENDING, GATHER)
            tok = _scores(qn_s, qr_s, kn_s.index(st), kr_s.index(st), s)
        else:
            tok = warpgroup_mma_init(s)
        return tok

    @gluon.jit
    def _softmax(s, ok, m_i, l_acc, dtype: gl.constexpr, p_layout: gl.constexpr,
                 mma_o: gl.constexpr, MAYBE_EMPTY: gl.constexpr = False):
        """One tile's online-softmax step: scores ``s`` (already scaled, columns ``ok``).
        Returns p as the value product's operand, the
        accumulator's rescale, the running max, and the running sums of p each thread keeps
        for its own columns (``l_acc``; one reduction after the last tile instead of one a
        tile across the warpgroups: 2-5% faster at 128 heads, decode_heads_defer_sum.json).
        ``MAYBE_EMPTY``: a tile may hold no token (a sparse tile of skipped slots)."""
        p, alpha, m_new, l_acc = _softmax_step(s, ok, m_i, l_acc, MAYBE_EMPTY)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        return p_op, gl.convert_layout(alpha, gl.SliceLayout(1, mma_o)), m_new, l_acc

    @gluon.jit
    def _softmax_step(s, ok, m_i, l_acc, MAYBE_EMPTY: gl.constexpr = False):
        """``_softmax``'s arithmetic: p in the scores' layout, the rescale, the running max
        and the threads' sums of p."""
        s = gl.where(ok[None, :], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))  # finite unless MAYBE_EMPTY
        m_use = m_new
        if MAYBE_EMPTY:
            m_use = gl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - m_use[:, None])
        return p, alpha, m_new, l_acc * alpha[:, None] + p

    @gluon.jit
    def _store_heads(acc, m_i, l_acc, g, pid, n, count, H, o_ptr, o_low_ptr, lse_ptr, out_ptr,
                     lse_out_ptr, stride_os, stride_oh, stride_ls, stride_outn, stride_outh,
                     stride_lon, L: gl.constexpr, LOW_SPLITS: gl.constexpr,
                     mma_s: gl.constexpr, mma_o: gl.constexpr, num_warps: gl.constexpr):
        """The program's 64 heads normalised (``acc``, the running max ``m_i`` and the
        threads' sums ``l_acc``) into the output (a request's only split) or the split's
        partial rows and lse, as the plan says."""
        l_i = gl.sum(l_acc, axis=1)
        has = l_i > 0.0
        l_safe = gl.where(has, l_i, 1.0)
        lse = gl.where(has, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        res = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, mma_o))[:, None]
        heads = g * GH + gl.arange(0, GH, layout=gl.SliceLayout(1, mma_o))
        oc = gl.arange(0, L, layout=gl.SliceLayout(0, mma_o))
        mask = (heads < H)[:, None]
        lh = g * GH + gl.arange(0, GH, layout=gl.SliceLayout(1, mma_s))
        if count == 1:
            # the output from a layout of 8 consecutive columns a thread (one pass through
            # shared memory, which the stages have freed): the MMA's layout wrote 4-byte
            # pieces (128 x 1K 0.1054 -> 0.0966 ms a layer, 64 x 4K 0.1805 -> 0.1785); the
            # partial rows keep the MMA's stores (through it: 2 x 128K, fp32 rows, 0.1777
            # -> 0.184; the sparse form's 16-bit rows 2-3% slower)
            row8: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
            h_st = g * GH + gl.arange(0, GH, layout=gl.SliceLayout(1, row8))
            c_st = gl.arange(0, L, layout=gl.SliceLayout(0, row8))
            o = out_ptr + n.to(gl.int64) * stride_outn + h_st[:, None] * stride_outh
            gl.store(o + c_st[None, :],
                     gl.convert_layout(res.to(out_ptr.dtype.element_ty), row8),
                     mask=(h_st < H)[:, None])
            gl.store(lse_out_ptr + n * stride_lon + lh, lse, mask=lh < H)
        else:
            part = pid * stride_os + heads[:, None] * stride_oh + oc[None, :]
            if count <= LOW_SPLITS:
                gl.store(o_low_ptr + part, res.to(o_low_ptr.dtype.element_ty), mask=mask)
            else:
                gl.store(o_ptr + part, res, mask=mask)
            gl.store(lse_ptr + pid * stride_ls + lh, lse, mask=lh < H)

    # splits stays a runtime int: one split a row compiled as a constant 1 trips an assertion
    # in Triton 3.6's lowering to LLVM
    @gluon.jit(do_not_specialize=["splits"])
    def _mla_decode_heads_gluon_kernel(
        qn_desc, qr_desc, kn_desc, kr_desc,  # TMA: q (N * H, L + R), kv rows
        bt_ptr,  # (N, max_pages) int
        o_ptr,  # (P, 1, H, L) fp32 partial rows
        o_low_ptr,  # (P, 1, H, L) 16-bit partial rows (o_ptr's strides)
        lse_ptr,  # (P, 1, H) fp32
        out_ptr,  # (N, H, L)
        lse_out_ptr,  # (N, H) fp32
        plan_ptr,  # (programs, 4) int32: request, splits, start, end
        kv_ptr,  # (pages, PS, L + R) (GATHER: bt_ptr is then (N, K) slots)
        qk_scale, H, N,
        splits, split_len, K,  # GATHER: each row's K slots in splits of split_len
        stride_btn, stride_btp,
        stride_kvp, stride_kvs,
        stride_os, stride_oh,
        stride_ls,
        stride_outn, stride_outh,
        stride_lon,
        L: gl.constexpr, R: gl.constexpr, PS: gl.constexpr,
        LOW_SPLITS: gl.constexpr, GATHER: gl.constexpr, num_warps: gl.constexpr,
    ):
        g = gl.program_id(0)
        pid = gl.program_id(1)
        n, count, start, end = _plan_item(plan_ptr, pid, N, splits, split_len, K, GATHER)
        if n < N:
            dtype: gl.constexpr = kn_desc.dtype
            mma_s: gl.constexpr = gl.NVMMADistributedLayout(  # an MMA's K: 32 bytes
                version=[3, 0], warps_per_cta=[4, 2],
                instr_shape=[16, GN // 2, 256 // dtype.primitive_bitwidth])
            mma_o: gl.constexpr = gl.NVMMADistributedLayout(
                version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, L // 2, 16])
            p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o,
                                                         k_width=2)
            qn_s = gl.allocate_shared_memory(dtype, [GH, L], qn_desc.layout)
            qr_s = gl.allocate_shared_memory(dtype, [GH, R], qr_desc.layout)
            kn_s = gl.allocate_shared_memory(dtype, [2, GN, L], kn_desc.layout)
            kr_s = gl.allocate_shared_memory(dtype, [2, GN, R], kr_desc.layout)
            bars = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
            bt_row = bt_ptr + n.to(gl.int64) * stride_btn
            tiles = (end - start + GN - 1) // GN
            _start_copies(qn_desc, qr_desc, kn_desc, kr_desc, None, n * H + g * GH, bt_row,
                          stride_btp, start, tiles, qn_s, qr_s, kn_s, kr_s, None, bars, kv_ptr,
                          stride_kvp, stride_kvs, end, L, PS, GATHER, num_warps)
            mbarrier.wait(bars.index(2), 0)

            acc = gl.zeros((GH, L), gl.float32, layout=mma_o)
            m_i = gl.full((GH,), float("-inf"), gl.float32, layout=gl.SliceLayout(1, mma_s))
            l_acc = gl.zeros((GH, GN), gl.float32, layout=mma_s)  # p's sums, a thread's columns
            cols = gl.arange(0, GN, layout=gl.SliceLayout(0, mma_s))
            s = gl.zeros((GH, GN), gl.float32, layout=mma_s)
            if tiles > 0:  # tile 0's scores
                _wait_tile(bars, 0, 0, 1, GATHER)
                s = warpgroup_mma_wait(0, deps=(_scores(qn_s, qr_s, kn_s.index(0),
                                                        kr_s.index(0), s),))
            for i in range(tiles):  # s: tile i's scores
                st = i % 2
                t0 = start + i * GN
                kn = kn_s.index(st)
                ok = _tile_rows(bt_row, stride_btp, t0, end, cols, 0, 0, PS, GATHER)[1]
                p_op, alpha_o, m_i, l_acc = _softmax(s * qk_scale, ok, m_i, l_acc, dtype,
                                                     p_layout, mma_o, GATHER)
                if not GATHER:  # (gathered rows past the range are zeros)
                    if t0 + GN > end:  # the split's last, partial tile
                        _zero_rows_past(kn, end - t0, L, num_warps)
                        fence_async_shared()
                        gl.thread_barrier()
                acc_tok = warpgroup_mma(p_op, kn, acc * alpha_o[:, None], is_async=True)
                # tile i + 1's scores after this tile's value product, so its copy has had
                # the softmax's time to land (issued before the softmax, they waited on a
                # copy just started: 26% slower, decode_heads_gluon.json)
                s_tok = _next_scores(qn_s, qr_s, kn_s, kr_s, bars, s, i, i + 1 < tiles, 0,
                                     GATHER)
                acc, s = warpgroup_mma_wait(0, deps=(acc_tok, s_tok))
                # both warpgroups are done with this stage: refill it
                _refill(kn_desc, kr_desc, None, bt_row, stride_btp, t0 + 2 * GN, end, kn,
                        kr_s.index(st), None, bars.index(st), i + 2 < tiles, kv_ptr,
                        stride_kvp, stride_kvs, L, PS, GATHER, num_warps)
            for i in gl.static_range(3):
                mbarrier.invalidate(bars.index(i))

            _store_heads(acc, m_i, l_acc, g, pid, n, count, H, o_ptr, o_low_ptr, lse_ptr,
                         out_ptr, lse_out_ptr, stride_os, stride_oh, stride_ls, stride_outn,
                         stride_outh, stride_lon, L, LOW_SPLITS, mma_s, mma_o, num_warps)


def launch(q: torch.Tensor, kv: torch.Tensor, block_table: torch.Tensor,
           o_part: torch.Tensor, o_low: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor,
           lse: torch.Tensor, items: torch.Tensor | None, qk_scale: float, low: int,
           sparse: tuple[int, int] | None = None) -> None:
    """Head groups of 64 x one program per plan item (``_decode_plan_kernel``'s); the rest
    as the balanced Triton launch takes them; 16-bit KV of q's dtype. With ``sparse`` =
    (splits, split_len), ``block_table`` is ``mla_sparse``'s (N, K) slots and the programs
    are each row's splits (partial rows (splits * N, 1, H, L), split-major), without a
    plan."""
    N, H, D = q.shape
    L = out.shape[2]
    if kv.dtype != q.dtype:
        raise ValueError(f"the many-head Gluon kernel reads 16-bit KV of q's dtype ({q.dtype}); "
                         f"got {kv.dtype} (e4m3: mla_decode_heads_fp8_ws)")
    rows_q, rows_kv = tma_rows(q, kv)
    splits, split_len = sparse or (1, 0)
    programs = items.shape[0] if items is not None else splits * N
    _mla_decode_heads_gluon_kernel[((H + BH - 1) // BH, programs)](
        descriptor(rows_q, L), descriptor(rows_q, D - L), descriptor(rows_kv, L),
        descriptor(rows_kv, D - L), block_table, o_part, o_low, lse_part, out, lse,
        block_table if items is None else items, kv, qk_scale, H, N, splits, split_len,
        block_table.shape[1], block_table.stride(0), block_table.stride(1), kv.stride(0),
        kv.stride(1), o_part.stride(0), o_part.stride(2), lse_part.stride(0), out.stride(0),
        out.stride(1), lse.stride(0), L=L, R=D - L, PS=kv.shape[1], LOW_SPLITS=low,
        GATHER=sparse is not None, num_warps=8, launch_pdl=pdl(q.device),
    )
