"""How a Gluon decode program gets its KV tiles on Hopper, shared by the many-head and the
few-head kernels (``mla_decode_heads_gluon``, ``mla_decode_tokens_gluon``).

A program serves a plan item of ``mla_decode``'s balanced plan (a request's token range over
its block table), or with ``GATHER`` a split of one row's slot list for ``mla_sparse``. Its
64-token tiles come into shared memory in stages, asynchronously, so the next tile's copy runs
under this tile's products:
- paged (dense decode): one TMA copy of a page's 64 rows for the latent and one for the rope
  columns (with fp8 KV in the few-head kernel, one more of their 64 scales: a row of the
  scales' (pages, PS) array, ``scale_descriptor``), signalling the stage's mbarrier
  (``_load_tile``);
- gathered (sparse): each of the tile's 64 selected rows by cp.async, 16 bytes a copy, one
  commit group a tile (``_gather_tile``; their fp8 scales likewise, ``_gather_scales``); a
  slot of -1 or past the list is a row of zeros.
``_start_copies`` issues the query's copy and the first two tiles, ``_wait_tile`` waits for a
stage, ``_refill`` issues the tile two ahead into a stage every warp is done with (its page
from the split's page ids staged in shared memory once, ``_stage_pages`` / ``_page_of``,
where a kernel passes them: the few-head fp8 kernel and the DSA indexer), and
``_tile_rows`` gives a tile's columns that hold a token (and, for the fp8 scales, their
offsets), ``_tile_scales`` the scales a copy brought. The fp8 kernels read q in e4m3, each
program quantising its own heads' 16-bit rows (``_query_rows`` loads them, ahead of the first
tiles' copies; ``_quantised_query`` writes them into ``_query_buffers`` with a scale a head,
``quantise_rows``' operations). TMA descriptors: ``descriptor`` over the rows ``tma_rows``
and ``kv_rows`` view. Every kernel starts with ``_plan_item``, whose first
step waits for the kernel before (programmatic dependent launch, ``_pdl_wait``).
"""

from __future__ import annotations

import torch

try:  # Gluon ships with Triton 3.5 and later
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - an older Triton: the Triton kernels serve
    gluon = None

BN = 64  # tokens a tile


if gluon is not None:
    GN = gl.constexpr(BN)
    PAGE_IDS = gl.constexpr(256)  # a split's page ids staged in shared memory (_stage_pages)

    @gluon.jit
    def _pdl_wait():
        """Until the kernel before this one in the stream has finished and its writes are
        visible: a kernel launched with ``launch_pdl`` (programmatic dependent launch) has its
        programs dispatched as soon as that kernel's have exited; without it, a no-op."""
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _pdl_trigger():
        """Lets the next kernel in the stream (launched with ``launch_pdl``: the merge) have its
        programs dispatched once every program of this one has called this or exited. The
        few-head kernels call it once a program's loop is done, so the merge's programs take
        SM slots only during the output stores, and wait there until this kernel has finished
        (H200, 16 heads, a layer: fp8 128 x 1K -1.5%, 8 x 4K -1%, 64 x 4K within noise; the
        many-head kernels 2-3% slower with it, so they do not)."""
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [],
                                  dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _plan_item(plan_ptr, pid, N, splits, split_len, K, GATHER: gl.constexpr):
        """Program ``pid``'s (request, or N past the last split; its splits; start; end): plan
        item ``pid``, or with ``GATHER`` split ``pid // N`` of row ``pid % N``'s slot list.
        Every Gluon decode kernel starts here, so this is where it waits for the kernel before
        (``_pdl_wait``): nothing is read before."""
        _pdl_wait()
        if GATHER:
            start = (pid // N) * split_len
            return pid % N, splits, start, gl.minimum(start + split_len, K)
        else:
            item = plan_ptr + pid * 4
            return gl.load(item), gl.load(item + 1), gl.load(item + 2), gl.load(item + 3)

    @gluon.jit
    def _page_buffer():
        """Shared memory for a split's staged page ids (``_stage_pages``, ``_page_of``)."""
        return gl.allocate_shared_memory(gl.int32, [PAGE_IDS, 1],
                                         gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))

    @gluon.jit
    def _stage_pages(bt_row, stride_btp, start, end, pages, PS: gl.constexpr,
                     num_warps: gl.constexpr):
        """The page ids of the split [start, end) (its first ``pages.shape[0]``) into
        ``pages``, shared memory the refills read them from (``_page_of``): issued once,
        before the loop, instead of a block-table load on each refill's path."""
        CAP: gl.constexpr = pages.shape[0]
        ld: gl.constexpr = gl.BlockedLayout([CAP // (32 * num_warps), 1], [32, 1],
                                            [num_warps, 1], [1, 0])
        j = gl.arange(0, CAP, layout=gl.SliceLayout(1, ld))
        p0 = start // PS
        ids = gl.load(bt_row + (p0 + j) * stride_btp, mask=j < (end + PS - 1) // PS - p0,
                      other=0)
        pages.store(gl.expand_dims(ids.to(gl.int32), 1))

    @gluon.jit
    def _page_of(bt_row, stride_btp, t0, pages, start, PS: gl.constexpr):
        """The page holding token ``t0``: from the staged ids (``_stage_pages``, visible after
        a thread barrier) when ``pages`` is not None and holds it, else the block table's."""
        if pages is None:
            page = gl.load(bt_row + (t0 // PS) * stride_btp)
        else:
            j = t0 // PS - start // PS
            if j < pages.shape[0]:
                one: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
                rows = pages._reinterpret(gl.int32, pages.shape, gl.SwizzledSharedLayout(
                    1, 1, 1, [0]))  # a row of one id, read by index
                page = gl.sum(rows.index(j).load(one), axis=0)
            else:
                page = gl.load(bt_row + (t0 // PS) * stride_btp).to(gl.int32)
        return page

    @gluon.jit
    def _load_tile(kn_desc, kr_desc, ks_desc, bt_row, stride_btp, t0, kn, kr, ks, bar,
                   L: gl.constexpr, PS: gl.constexpr, pages=None, start=0):
        """The tile at token ``t0`` (its page's rows) into ``kn`` / ``kr`` (and its rows' fp8
        scales into ``ks`` unless ``ks_desc`` is None), signalling ``bar``; its page from
        ``pages`` (``_page_of``)."""
        page = _page_of(bt_row, stride_btp, t0, pages, start, PS)
        row = page * PS + t0 % PS
        if ks_desc is None:
            mbarrier.expect(bar, kn_desc.block_type.nbytes + kr_desc.block_type.nbytes)
        else:
            mbarrier.expect(bar, kn_desc.block_type.nbytes + kr_desc.block_type.nbytes
                            + ks_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(ks_desc, [page, t0 % PS], bar, ks)
        tma.async_copy_global_to_shared(kn_desc, [row, 0], bar, kn)
        tma.async_copy_global_to_shared(kr_desc, [row, L], bar, kr)

    @gluon.jit
    def _gather_cols(dst, kv_ptr, slot_row, stride_slk, stride_kvp, stride_kvs, j0, end,
                     OFF: gl.constexpr, PS: gl.constexpr, ld: gl.constexpr):
        """cp.async of columns [OFF, OFF + dst's width) of the rows at slots j0.. into
        ``dst``; a slot past ``end`` or of -1 gives a row of zeros."""
        j = j0 + gl.arange(0, dst.shape[0], layout=gl.SliceLayout(1, ld))
        slot = gl.load(slot_row + j * stride_slk, mask=j < end, other=-1)
        # rows start 16-byte aligned (``usable``): cp.async moves 16 bytes a copy
        base = gl.multiple_of((slot // PS).to(gl.int64) * stride_kvp + (slot % PS) * stride_kvs,
                              128 // dst.dtype.primitive_bitwidth) + OFF
        cols = gl.arange(0, dst.shape[1], layout=gl.SliceLayout(0, ld))
        async_copy.async_copy_global_to_shared(dst, kv_ptr + base[:, None] + cols[None, :],
                                               mask=(slot >= 0)[:, None])

    @gluon.jit
    def _gather_tile(kv_ptr, slot_row, stride_slk, stride_kvp, stride_kvs, j0, end, kn, kr,
                     L: gl.constexpr, PS: gl.constexpr, num_warps: gl.constexpr,
                     ROW_THREADS: gl.constexpr = 32):
        """The KV rows at slots j0.. (a sparse tile) into ``kn`` / ``kr`` by cp.async, 16
        bytes a copy, issued (the caller commits the group); ``ROW_THREADS`` threads across a
        row's latent (fewer: fewer rows a thread, so fewer row addresses held at once)."""
        VEC: gl.constexpr = 128 // kn.dtype.primitive_bitwidth
        RT: gl.constexpr = kr.shape[1] // VEC  # threads across the rope columns
        ldn: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // ROW_THREADS, ROW_THREADS],
                                             [num_warps, 1], [1, 0])
        ldr: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // RT, RT], [num_warps, 1], [1, 0])
        _gather_cols(kn, kv_ptr, slot_row, stride_slk, stride_kvp, stride_kvs, j0, end, 0, PS,
                     ldn)
        _gather_cols(kr, kv_ptr, slot_row, stride_slk, stride_kvp, stride_kvs, j0, end, L, PS,
                     ldr)

    @gluon.jit
    def _gather_scales(ks, scale_ptr, slot_row, stride_slk, stride_sp, stride_ss, j0, end,
                       PS: gl.constexpr, num_warps: gl.constexpr):
        """cp.async of the fp8 scales of the rows at slots j0.. (a sparse tile) into ``ks``,
        the stage's (1, BN) row that ``_tile_scales`` reads; 0 for a slot past ``end`` or
        of -1."""
        ld: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        j = j0 + gl.arange(0, GN, layout=ld)
        slot = gl.load(slot_row + j * stride_slk, mask=j < end, other=-1)
        off = (slot // PS).to(gl.int64) * stride_sp + (slot % PS) * stride_ss
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        async_copy.async_copy_global_to_shared(ks._reinterpret(gl.float32, [GN], flat),
                                               scale_ptr + off, mask=slot >= 0)

    @gluon.jit
    def _start_copies(qn_desc, qr_desc, kn_desc, kr_desc, ks_desc, row_q, bt_row, stride_btp,
                      start, tiles, qn_s, qr_s, kn_s, kr_s, ks_s, bars, kv_ptr, stride_kvp,
                      stride_kvs, end, L: gl.constexpr, PS: gl.constexpr, GATHER: gl.constexpr,
                      num_warps: gl.constexpr):
        """Barriers 0 and 1 for the two tile stages, 2 for the query; the query's copy (unless
        ``qn_desc`` is None) and the first two tiles' issued, with their scales by ``ks_desc``
        into ``ks_s`` unless None (with ``GATHER``, ``bt_row`` is the row's slot list and each
        tile one cp.async group, committed even when empty)."""
        for i in gl.static_range(3):
            mbarrier.init(bars.index(i), count=1)
        if qn_desc is not None:  # (None: the caller writes the query itself)
            mbarrier.expect(bars.index(2), qn_desc.block_type.nbytes + qr_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(qn_desc, [row_q, 0], bars.index(2), qn_s)
            tma.async_copy_global_to_shared(qr_desc, [row_q, L], bars.index(2), qr_s)
        for j in gl.static_range(2):
            if GATHER:
                if j < tiles:
                    _gather_tile(kv_ptr, bt_row, stride_btp, stride_kvp, stride_kvs,
                                 start + j * GN, end, kn_s.index(j), kr_s.index(j), L, PS,
                                 num_warps)
                async_copy.commit_group()
            else:
                if j < tiles:
                    ks = ks_s
                    if ks_desc is not None:
                        ks = ks_s.index(j)
                    _load_tile(kn_desc, kr_desc, ks_desc, bt_row, stride_btp, start + j * GN,
                               kn_s.index(j), kr_s.index(j), ks, bars.index(j), L, PS)

    @gluon.jit
    def _refill(kn_desc, kr_desc, ks_desc, bt_row, stride_btp, t0, end, kn, kr, ks, bar, more,
                kv_ptr, stride_kvp, stride_kvs, L: gl.constexpr, PS: gl.constexpr,
                GATHER: gl.constexpr, num_warps: gl.constexpr, pages=None, start=0):
        """A stage every warp is done with refilled with the tile at ``t0`` (and its scales
        unless ``ks_desc`` is None) when ``more`` (with ``GATHER`` a cp.async group is
        committed either way)."""
        if more:
            gl.thread_barrier()
            if GATHER:
                _gather_tile(kv_ptr, bt_row, stride_btp, stride_kvp, stride_kvs, t0, end, kn,
                             kr, L, PS, num_warps)
            else:
                _load_tile(kn_desc, kr_desc, ks_desc, bt_row, stride_btp, t0, kn, kr, ks, bar, L,
                           PS, pages, start)
        if GATHER:
            async_copy.commit_group()

    @gluon.jit
    def _wait_tile(bars, st, phase, PENDING: gl.constexpr, GATHER: gl.constexpr):
        """Until stage ``st``'s tile has landed: its barrier's ``phase``, or with ``GATHER``
        at most ``PENDING`` of this thread's cp.async groups in flight, then every thread's
        (fenced for the products' reads)."""
        if GATHER:
            async_copy.wait_group(PENDING)
            fence_async_shared()
            gl.thread_barrier()
        else:
            mbarrier.wait(bars.index(st), phase)

    @gluon.jit
    def _tile_rows(bt_row, stride_btp, t0, end, rows, stride_p, stride_s, PS: gl.constexpr,
                   GATHER: gl.constexpr):
        """For the tile's ``rows`` (any layout): the offsets of their slots in a (pages, PS)
        array of strides (``stride_p``, ``stride_s``) and whether each holds a token: before
        ``end``, and with ``GATHER`` (``bt_row`` the slot list) of a slot other than -1."""
        ok = t0 + rows < end
        if GATHER:
            slot = gl.load(bt_row + (t0 + rows) * stride_btp, mask=ok, other=-1)
            ok = slot >= 0
            off = (slot // PS).to(gl.int64) * stride_p + (slot % PS) * stride_s
        else:
            page = gl.load(bt_row + (t0 // PS) * stride_btp).to(gl.int64)
            off = page * stride_p + (t0 % PS + rows) * stride_s
        return off, ok

    @gluon.jit
    def _tile_scales(ks, t0, end, rows):
        """The tile at ``t0``'s fp8 scales as its copy brought them (``ks``, a (1, BN) row in
        shared memory) for its ``rows`` (any layout; 0 from ``end`` on, where a page's unused
        rows may hold anything), and which of the rows hold a token."""
        ok = t0 + rows < end
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        s = ks._reinterpret(gl.float32, [GN], flat).load(rows.type.layout)
        return gl.where(ok, s, gl.zeros_like(s)), ok

    @gluon.jit
    def _query_buffers(BH: gl.constexpr, L: gl.constexpr, R: gl.constexpr):
        """Shared memory for the e4m3 query rows ``_quantised_query`` writes: (latent, rope)."""
        qn_s = gl.allocate_shared_memory(
            gl.float8e4nv, [BH, L], gl.NVMMASharedLayout.get_default_for([BH, L], gl.float8e4nv))
        qr_s = gl.allocate_shared_memory(
            gl.float8e4nv, [BH, R], gl.NVMMASharedLayout.get_default_for([BH, R], gl.float8e4nv))
        return qn_s, qr_s

    @gluon.constexpr_function
    def _query_layout(cols, num_warps):
        """q rows (heads x ``cols``) for their loads and quantisation: a warp a head, a
        thread's ``cols`` / 32 consecutive columns."""
        return gl.BlockedLayout([1, cols // 32], [1, 32], [num_warps, 1], [1, 0])

    @gluon.jit
    def _query_rows(q_ptr, stride_qh, H, L: gl.constexpr, R: gl.constexpr, BH: gl.constexpr,
                    num_warps: gl.constexpr):
        """The request's 16-bit q rows (latent, rope; heads past ``H`` as 0) loaded into
        registers: issued ahead of the first tiles' copies, so they do not queue behind every
        program's (16 heads, 64 x 4K: from the program's start to its quantised query 6.3 us
        loaded after the copies, ~2.6 where L2 held q)."""
        ln: gl.constexpr = _query_layout(L, num_warps)
        lr: gl.constexpr = _query_layout(R, num_warps)
        hn = gl.arange(0, BH, layout=gl.SliceLayout(1, ln))
        hr = gl.arange(0, BH, layout=gl.SliceLayout(1, lr))
        cn = gl.arange(0, L, layout=gl.SliceLayout(0, ln))
        cr = gl.arange(0, R, layout=gl.SliceLayout(0, lr))
        xn = gl.load(q_ptr + hn[:, None] * stride_qh + cn[None, :], mask=(hn < H)[:, None],
                     other=0.0)
        xr = gl.load(q_ptr + hr[:, None] * stride_qh + L + cr[None, :], mask=(hr < H)[:, None],
                     other=0.0)
        return xn, xr

    @gluon.jit
    def _quantised_query(xn, xr, qn_s, qr_s, L: gl.constexpr, R: gl.constexpr,
                         num_warps: gl.constexpr):
        """q rows ``xn`` / ``xr`` (``_query_rows``) quantised to e4m3 with a scale a head, as
        ``quantise_rows`` does (amax / 448, the same operations), into ``qn_s`` / ``qr_s``;
        returns the scales."""
        ln: gl.constexpr = _query_layout(L, num_warps)
        lr: gl.constexpr = _query_layout(R, num_warps)
        xn = xn.to(gl.float32)
        xr = xr.to(gl.float32)
        amax = gl.maximum(gl.max(gl.abs(xn), axis=1),
                          gl.convert_layout(gl.max(gl.abs(xr), axis=1), gl.SliceLayout(1, ln)))
        scale = amax / 448.0
        inv = gl.where(scale > 0.0, 1.0 / gl.where(scale > 0.0, scale, 1.0), 0.0)
        qn = gl.minimum(gl.maximum(xn * inv[:, None], -448.0), 448.0)
        inv_r = gl.convert_layout(inv, gl.SliceLayout(1, lr))
        qr = gl.minimum(gl.maximum(xr * inv_r[:, None], -448.0), 448.0)
        qn_s.store(qn.to(gl.float8e4nv))
        qr_s.store(qr.to(gl.float8e4nv))
        fence_async_shared()
        gl.thread_barrier()
        return scale

    @gluon.jit
    def _zero_rows_past(kn, valid, L: gl.constexpr, num_warps: gl.constexpr):
        """Rows ``valid`` and on of the tile's value columns set to 0 in shared memory."""
        CW: gl.constexpr = 64
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [num_warps, 1], [1, 0])
        rows = gl.arange(0, GN, layout=gl.SliceLayout(1, ld))
        for c in gl.static_range(L // CW):
            part = kn.slice(c * CW, CW, dim=1)
            x = part.load(ld)
            part.store(gl.where((rows < valid)[:, None], x, gl.zeros_like(x)))


def descriptor(t: torch.Tensor, cols: int, rows: int = BN) -> TensorDescriptor:
    """A TMA descriptor over the 2-D ``t`` that copies (rows, cols) boxes."""
    dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16,
             torch.float8_e4m3fn: gl.float8e4nv}[t.dtype]
    layout = gl.NVMMASharedLayout.get_default_for([rows, cols], dtype)
    return TensorDescriptor.from_tensor(t, [rows, cols], layout)


def scale_descriptor(scale: torch.Tensor) -> TensorDescriptor:
    """A TMA descriptor over the fp8 scales (pages, PS) fp32 that copies a tile's row (1, BN),
    unswizzled (a copy of the scales where their strides do not suit TMA)."""
    if scale.stride(1) != 1 or scale.stride(0) % 4 or scale.data_ptr() % 16:
        scale = scale.contiguous()
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return TensorDescriptor.from_tensor(scale, [1, BN], layout)


def kv_rows(kv: torch.Tensor) -> torch.Tensor:
    """The paged cache (pages, PS, D) as (pages * PS, D) rows, as a TMA descriptor takes them."""
    D = kv.shape[2]
    return kv.view(kv.shape[0] * kv.shape[1], D) if kv.is_contiguous() else \
        kv.as_strided((kv.shape[0] * kv.shape[1], D), (kv.stride(1), 1))


def tma_rows(q: torch.Tensor, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q (N, H, D) as (N * H, D) rows and the paged cache as ``kv_rows``, as TMA descriptors
    take them (16-byte aligned, unit stride last)."""
    N, H, D = q.shape
    rows_q = q.reshape(N * H, D)
    if rows_q.stride(1) != 1 or rows_q.stride(0) % 8 or rows_q.data_ptr() % 16:
        rows_q = rows_q.contiguous()
    return rows_q, kv_rows(kv)
