"""Page ids loaded once and gathered per tile, for the attention kernels' paged loops.

A loop whose tile addresses come from a load inside it (a page id from the block table) is not
software-pipelined by Triton (3.6): compiled for sm_90 such a loop waits for every outstanding
copy at the top of each iteration, whatever ``num_stages`` says, so no load overlaps the
products. Loading a block of ids before the loop and gathering each tile's from registers
(``tl.gather``) removes that load: the loop then keeps ``num_stages - 2`` tiles' copies in
flight. ``mla_decode`` walks a split in such blocks (``_page_block``); ``index_scores`` loads
a program's ids at once; ``mla_sparse`` its split's slot ids (``_split_slots``, ``_tile_slots``).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_page_ids(bt_row_ptr, first_page, end, stride_btp, PAGE_SIZE: tl.constexpr,
                   PAGES: tl.constexpr):
    """PAGES page ids of a block table row from ``first_page`` on, loaded once (ids of pages
    holding no token before ``end`` read as 0): what ``_gather_page_ids`` looks tiles up in."""
    offs_p = first_page + tl.arange(0, PAGES)
    return tl.load(bt_row_ptr + offs_p * stride_btp, mask=offs_p * PAGE_SIZE < end, other=0)


@triton.jit
def _gather_page_ids(pages, first_page, offs_t, PAGE_SIZE: tl.constexpr, PAGES: tl.constexpr):
    """The page id of each token ``offs_t`` from ``_load_page_ids``' registers (clamped into
    them): a gather, not a load, so no load inside a loop gates the tiles' copies (Triton's
    pipeliner runs no copy ahead of one)."""
    slot = tl.minimum(tl.maximum(offs_t // PAGE_SIZE - first_page, 0), PAGES - 1)
    return tl.gather(pages, slot, 0)


@triton.jit
def _page_block(bt_row_ptr, b0, start, full_end, end, stride_btp, PAGE_SIZE: tl.constexpr,
                PAGES: tl.constexpr):
    """The block of PAGES pages from token ``b0`` (page-aligned) of a split [start, full_end):
    its first page, the page ids (ids of pages past ``end`` 0) and the block's token range."""
    first_page = b0 // PAGE_SIZE
    pages = _load_page_ids(bt_row_ptr, first_page, end, stride_btp, PAGE_SIZE, PAGES)
    return first_page, pages, tl.maximum(start, b0), tl.minimum(full_end, b0 + PAGES * PAGE_SIZE)


@triton.jit
def _split_slots(slots_ptr, pid_n, pid_s, K, num_splits, stride_sln, stride_slk,
                 BLOCK_N: tl.constexpr, SLOTS: tl.constexpr):
    """Split ``pid_s`` of row ``pid_n``'s ``K`` slot ids (whole tiles of ``BLOCK_N``): the row's
    slot pointer, the split's [start, end), and with ``SLOTS`` > 0 its ids loaded once (at most
    SLOTS) for ``_tile_slots`` to gather."""
    split_len = tl.cdiv(tl.cdiv(K, num_splits), BLOCK_N) * BLOCK_N
    start = pid_s * split_len
    end = tl.minimum(start + split_len, K)
    slot_row = slots_ptr + pid_n * stride_sln
    chosen = start  # unused without SLOTS
    if SLOTS > 0:
        offs_c = start + tl.arange(0, SLOTS)
        chosen = tl.load(slot_row + offs_c * stride_slk, mask=offs_c < end, other=-1)
    return slot_row, start, end, chosen


@triton.jit
def _tile_slots(chosen, slot_row, j0, start, end, stride_slk, BLOCK_N: tl.constexpr,
                SLOTS: tl.constexpr):
    """The tile at ``j0``'s slots (int64; 0 where none) and which are valid (-1 entries and
    those past the split's end are not): gathered from ``chosen`` or loaded."""
    offs_j = j0 + tl.arange(0, BLOCK_N)
    if SLOTS > 0:
        slot = tl.gather(chosen, tl.minimum(offs_j - start, SLOTS - 1), 0).to(tl.int64)
        slot = tl.where(offs_j < end, slot, -1)
    else:
        slot = tl.load(slot_row + offs_j * stride_slk, mask=offs_j < end, other=-1).to(tl.int64)
    valid = slot >= 0
    return tl.where(valid, slot, 0), valid
