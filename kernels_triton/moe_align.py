"""Token-expert pairs sorted by expert for the grouped GEMMs of ``fused_moe``.

The pairs (M = N·k, pair p = t·k + j) are grouped by expert and each expert's run is padded to a
multiple of BLOCK_M (padding slots hold the sentinel M), so every BLOCK_M block of the sorted
list belongs to one expert (``block_expert``; -1 past the end). No value is read back to the
host (CUDA-graph safe); the list is sized for the worst case M + min(E, M)·(BLOCK_M - 1).
Three small kernels (count with atomics, one program for the padded runs, scatter with atomic
cursors), or for a decode step's few pairs one program that does it all.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splash.kernels_triton import _validate as V


@triton.jit(do_not_specialize=["M"])  # ints that vary by step: one binary for all
def _moe_count_kernel(ids_ptr, counts_ptr, M, BLOCK: tl.constexpr):
    """counts[e] += number of pairs routed to expert e (one program per BLOCK pairs)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M
    e = tl.load(ids_ptr + offs, mask=ok, other=0)
    tl.atomic_add(counts_ptr + e, tl.full((BLOCK,), 1, tl.int32), mask=ok)


@triton.jit(do_not_specialize=["num_blocks"])  # ints that vary by step: one binary for all
def _moe_runs_kernel(counts_ptr, cursor_ptr, block_expert_ptr, E, num_blocks,
                     BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr):
    """One program: each expert's run padded to BLOCK_M, its start (the scatter's cursor) and
    the expert of every BLOCK_M block (-1 past the last run)."""
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    counts = tl.load(counts_ptr + offs_e, mask=e_ok, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    run_end = tl.cumsum(padded, 0)
    tl.store(cursor_ptr + offs_e, run_end - padded, mask=e_ok)
    for b0 in range(0, num_blocks, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        start = offs_b * BLOCK_M
        # runs ending at or before the block's start (empty runs included): its expert
        before = (run_end[None, :] <= start[:, None]) & e_ok[None, :]
        expert = tl.sum(before.to(tl.int32), axis=1)
        expert = tl.where(expert < E, expert, -1)
        tl.store(block_expert_ptr + offs_b, expert, mask=offs_b < num_blocks)


@triton.jit(do_not_specialize=["M"])  # ints that vary by step: one binary for all
def _moe_scatter_kernel(ids_ptr, cursor_ptr, sorted_ids_ptr, M, BLOCK: tl.constexpr):
    """Each pair takes the next slot of its expert's run (the order inside a run is free: every
    row of the grouped GEMMs is computed independently of the others)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M
    e = tl.load(ids_ptr + offs, mask=ok, other=0)
    slot = tl.atomic_add(cursor_ptr + e, tl.full((BLOCK,), 1, tl.int32), mask=ok)
    tl.store(sorted_ids_ptr + slot, offs, mask=ok)


@triton.jit(do_not_specialize=["M", "num_blocks"])  # ints that vary by step: one binary for all
def _moe_align_small_kernel(ids_ptr, sorted_ids_ptr, block_expert_ptr, M, E, num_blocks,
                            BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                            BLOCK_B: tl.constexpr):
    """The three kernels above (and the buffers' fills) in one program, for the few pairs of a
    decode step (M <= BLOCK): each pair's rank among its expert's pairs is counted against all
    the others at once, so no atomics and no cursor are needed."""
    offs = tl.arange(0, BLOCK)
    ok = offs < M
    e = tl.load(ids_ptr + offs, mask=ok, other=0)
    for s0 in range(0, num_blocks * BLOCK_M, BLOCK_B):  # padding first
        so = s0 + tl.arange(0, BLOCK_B)
        tl.store(sorted_ids_ptr + so, tl.full((BLOCK_B,), 0, tl.int32) + M,
                 mask=so < num_blocks * BLOCK_M)
    tl.debug_barrier()
    earlier = (e[:, None] == e[None, :]) & ok[None, :] & (offs[None, :] < offs[:, None])
    rank = tl.sum(earlier.to(tl.int32), axis=1)  # earlier pairs of the same expert
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    mine = (offs_e[:, None] == e[None, :]) & ok[None, :]  # (BLOCK_E, BLOCK)
    counts = tl.sum(mine.to(tl.int32), axis=1)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    run_end = tl.cumsum(padded, 0)
    run_start = tl.sum(tl.where(mine, (run_end - padded)[:, None], 0), axis=0)  # (BLOCK,)
    tl.store(sorted_ids_ptr + run_start + rank, offs, mask=ok)
    for b0 in range(0, num_blocks, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        before = (run_end[None, :] <= (offs_b * BLOCK_M)[:, None]) & e_ok[None, :]
        expert = tl.sum(before.to(tl.int32), axis=1)
        tl.store(block_expert_ptr + offs_b, tl.where(expert < E, expert, -1),
                 mask=offs_b < num_blocks)


SMALL_ALIGN = (128, 1 << 16)  # one-program alignment up to this many pairs and pairs × experts


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, one_program: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the N·k pairs by expert, each expert's run padded to a multiple of ``block_m``.

    Returns ``sorted_ids`` (num_blocks·block_m,) int32 (pair ids p = t·k + j, padding = N·k) and
    ``block_expert`` (num_blocks,) int32 (-1 for blocks past the last expert's run). Sized for
    the worst case, so no value is read back to the host. Three small Triton kernels (count,
    runs, scatter), or for a decode step's few pairs (``SMALL_ALIGN``; ``one_program`` forces
    either) one program that does it all; the order of pairs inside an expert's run is
    unspecified.
    """
    flat = topk_ids.reshape(-1).to(torch.int32)  # (M,)
    M, device = flat.numel(), flat.device
    num_blocks = triton.cdiv(M + min(num_experts, M) * (block_m - 1), block_m)
    block, block_e = V.next_pow2(M, 16), V.next_pow2(num_experts, 16)
    if one_program is None:
        one_program = M <= SMALL_ALIGN[0] and block * block_e <= SMALL_ALIGN[1]
    if one_program and M:
        sorted_ids = torch.empty((num_blocks * block_m,), dtype=torch.int32, device=device)
        block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
        _moe_align_small_kernel[(1,)](flat, sorted_ids, block_expert, M, num_experts, num_blocks,
                                      BLOCK=block, BLOCK_M=block_m, BLOCK_E=block_e,
                                      BLOCK_B=64 if device.type == "cuda" else 16, num_warps=4)
        return sorted_ids, block_expert
    state = torch.zeros(2 * num_experts, dtype=torch.int32, device=device)  # counts, cursor
    counts, cursor = state[:num_experts], state[num_experts:]
    sorted_ids = torch.full((num_blocks * block_m,), M, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    if M == 0:
        block_expert.fill_(-1)
        return sorted_ids, block_expert
    block = 1024 if device.type == "cuda" else 64
    grid = (triton.cdiv(M, block),)
    _moe_count_kernel[grid](flat, counts, M, BLOCK=block)
    _moe_runs_kernel[(1,)](counts, cursor, block_expert, num_experts, num_blocks,
                           BLOCK_M=block_m, BLOCK_E=V.next_pow2(num_experts),
                           BLOCK_B=64 if device.type == "cuda" else 16)
    _moe_scatter_kernel[grid](flat, cursor, sorted_ids, M, BLOCK=block)
    return sorted_ids, block_expert
