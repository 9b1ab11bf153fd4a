"""Merge partial attention results by log-sum-exp.

A partial result over a subset of the keys is ``(o_s, lse_s)``: the softmax-weighted value over
that subset and the natural log of its softmax denominator. S partials over disjoint subsets
(KV splits of one program, or KV shards of CP ranks) combine exactly:

    lse = log(sum_s exp(lse_s)),   o = sum_s exp(lse_s - lse) * o_s

A partial with ``lse_s = -inf`` covered no keys and contributes nothing (its ``o_s`` is never
read into the sum); when every partial is ``-inf`` the merged output is 0 and its lse ``-inf``.
The same kernel finishes split-KV decode (``mla_decode``), reading its fp32 partial buffer.
A program folds one partial at a time, a dependent chain of loads: loading eight a round
(their lse and rows in one 2-D load) was mixed on an H200, +-3% by batch, 64 x 4K and the DSA
layer unchanged (``benchmarks/results/h200/lse_merge_rounds.json``); all of a request's (at most
8) in one round was slower at every shape, 16 heads fp8 128 x 1K +28%, 64 x 4K +8%
(``lse_merge_one_round_tried.json``). Where one request is split
many ways, though (a 128K request among 63 of 1K: 137 partials at 16 heads), the chain is
the merge's whole time: a request of more than ``MANY`` partials folds ``ROUND`` a round, in a
binary built with that path only when the caller's bound says some request may need it (the
path's registers slow every other launch): 16 heads, that batch's layer 0.0675 -> 0.0626 ms
(fp8 KV), 8 x 4K 0.0204 -> 0.0197, uniform batches unchanged
(``benchmarks/results/h200/lse_merge_rounds_many.json``). Reading the plan's ranges before
the PDL wait instead of after it moved a layer within noise on an H100 (16 and 128 heads,
64 x 4K, bf16 and e4m3; ``results/h100/lse_merge_ranges_first_tried.json``): the merge is
dispatched once the attention programs have triggered or exited, and that window is short.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splash.kernels_triton import _validate as V
from splash.kernels_triton.pdl import pdl, pdl_enter

MANY, ROUND = 8, 16  # a request of more than MANY partials folds ROUND a round


@triton.jit
def _fold(o_base, lse_base, S, stride_os, stride_ls, mask_l, BLOCK_L: tl.constexpr):
    """Partials 0..S-1 from ``o_base`` / ``lse_base`` folded one at a time: (acc, denom, max)."""
    m = tl.full((), float("-inf"), tl.float32)  # running max of lse
    denom = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_L,), tl.float32)
    for s in range(0, S):
        lse_s = tl.load(lse_base + s * stride_ls).to(tl.float32)
        has_keys = lse_s > float("-inf")
        o_s = tl.load(o_base + s * stride_os, mask=mask_l, other=0.0).to(tl.float32)
        o_s = tl.where(has_keys, o_s, 0.0)  # never let an empty partial's o (maybe nan) in
        m_new = tl.maximum(m, lse_s)
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp(m - m_safe)  # 0 while nothing has been seen
        w = tl.where(has_keys, tl.exp(lse_s - m_safe), 0.0)
        acc = acc * alpha + w * o_s
        denom = denom * alpha + w
        m = m_new
    return acc, denom, m


@triton.jit
def _fold_rounds(o_base, lse_base, S, stride_os, stride_ls, mask_l, BLOCK_L: tl.constexpr,
                 ROUND: tl.constexpr):
    """``_fold`` over ``ROUND`` partials a round (their lse and rows in one load each): a
    request split many ways (one long request among short ones) waits S / ROUND dependent
    rounds instead of S."""
    m = tl.full((), float("-inf"), tl.float32)
    denom = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_L,), tl.float32)
    for s0 in range(0, S, ROUND):
        rows = s0 + tl.arange(0, ROUND)
        lse_r = tl.load(lse_base + rows * stride_ls, mask=rows < S,
                        other=float("-inf")).to(tl.float32)
        o_r = tl.load(o_base + rows[:, None] * stride_os,
                      mask=(rows < S)[:, None] & mask_l[None, :], other=0.0).to(tl.float32)
        has_keys = lse_r > float("-inf")
        o_r = tl.where(has_keys[:, None], o_r, 0.0)  # an empty partial's o (maybe nan) stays out
        m_new = tl.maximum(m, tl.max(lse_r, 0))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp(m - m_safe)
        w = tl.where(has_keys, tl.exp(lse_r - m_safe), 0.0)
        acc = acc * alpha + tl.sum(w[:, None] * o_r, 0)
        denom = denom * alpha + tl.sum(w, 0)
        m = m_new
    return acc, denom, m


@triton.jit(do_not_specialize=["S"])  # ints that vary by step: one binary for all
def _lse_merge_kernel(
    o_ptr,  # (S, N, H, L) partial outputs; RANGES: (rows, 1, H, L)
    o_low_ptr,  # RANGES: (rows, 1, H, L) 16-bit rows of requests of at most LOW_SPLITS
    lse_ptr,  # (S, N, H) fp32 partial lse (natural log); RANGES: (rows, 1, H)
    out_ptr,  # (N, H, L) merged output
    lse_out_ptr,  # (N, H) fp32 merged lse
    ranges_ptr,  # RANGES: (N + 1,) int32, request n's partials are rows [r[n], r[n + 1])
    S,
    stride_os, stride_on, stride_oh, stride_ol,
    stride_ls, stride_ln, stride_lh,
    stride_outn, stride_outh, stride_outl,
    stride_lon, stride_loh,
    L: tl.constexpr,
    BLOCK_L: tl.constexpr,
    RANGES: tl.constexpr,  # each request's own run of partial rows (a request of one wrote out)
    LOW_SPLITS: tl.constexpr,  # RANGES: a request of at most this many rows reads o_low_ptr
    MANY: tl.constexpr,  # more partials than this (0: none has) fold ROUND at a time
    ROUND: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    pid_h = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_l = tl.arange(0, BLOCK_L)
    mask_l = offs_l < L
    if RANGES:
        first = tl.load(ranges_ptr + pid_n)
        S = tl.load(ranges_ptr + pid_n + 1) - first
        if S <= 1:
            return
        o_off = first * stride_os + pid_h * stride_oh + offs_l * stride_ol
        lse_base = lse_ptr + first * stride_ls + pid_h * stride_lh
    else:
        o_off = pid_n * stride_on + pid_h * stride_oh + offs_l * stride_ol  # (BLOCK_L,)
        lse_base = lse_ptr + pid_n * stride_ln + pid_h * stride_lh
    if S <= LOW_SPLITS:  # (o_low_ptr shares o_ptr's strides)
        acc, denom, m = _fold(o_low_ptr + o_off, lse_base, S, stride_os, stride_ls, mask_l,
                              BLOCK_L)
    elif MANY and S > MANY:
        acc, denom, m = _fold_rounds(o_ptr + o_off, lse_base, S, stride_os, stride_ls, mask_l,
                                     BLOCK_L, ROUND)
    else:
        acc, denom, m = _fold(o_ptr + o_off, lse_base, S, stride_os, stride_ls, mask_l, BLOCK_L)

    has_any = denom > 0.0
    out = acc / tl.where(has_any, denom, 1.0)
    lse = tl.where(has_any, m + tl.log(tl.where(has_any, denom, 1.0)), float("-inf"))
    tl.store(
        out_ptr + pid_n * stride_outn + pid_h * stride_outh + offs_l * stride_outl,
        out.to(out_ptr.dtype.element_ty),
        mask=mask_l,
    )
    tl.store(lse_out_ptr + pid_n * stride_lon + pid_h * stride_loh, lse)


def _merge_into(
    outs: torch.Tensor, lses: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    ranges: torch.Tensor | None = None, num_warps: int = 4,
    low: tuple[torch.Tensor, int] | None = None, max_rows: int | None = None,
) -> None:
    """Launch the merge of ``outs`` (S, N, H, L) / ``lses`` (S, N, H) into preallocated tensors.
    With ``ranges`` (N + 1,) int32, request n's partials are instead the rows
    ``outs[ranges[n]:ranges[n + 1], 0]`` of (rows, 1, H, L) partials, and a request with a
    single row (which already wrote its output) is skipped; with ``low`` = (rows, n) as well,
    a request of at most n rows has them in ``rows`` (16-bit, ``outs``' shape and strides);
    ``max_rows``: the most rows any request can have, when the caller knows a bound (the
    binary then holds ``_fold_rounds`` only where some request may need it)."""
    N, H, L = out.shape
    if N == 0 or H == 0:
        return
    o_low, low_splits = low if ranges is not None and low is not None and low[1] else (outs, 0)
    most = outs.shape[0] if ranges is None or max_rows is None else max_rows
    _lse_merge_kernel[(H, N)](
        outs, o_low, lses, out, lse, lse if ranges is None else ranges,
        outs.shape[0] if ranges is None else 0,
        *outs.stride(), *lses.stride(), *out.stride(), *lse.stride(),
        L=L, BLOCK_L=V.next_pow2(L, 16), RANGES=ranges is not None, LOW_SPLITS=low_splits,
        MANY=MANY if most > MANY else 0, ROUND=ROUND, num_warps=num_warps,
        PDL=(on := pdl(out.device)), launch_pdl=on,
    )


def lse_merge(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge S partials: ``outs`` (S, N, H, L), ``lses`` (S, N, H) fp32 -> ``(out (N, H, L) in
    outs.dtype, lse (N, H) fp32)``. ``-inf`` partials are ignored; all ``-inf`` gives 0 / ``-inf``."""
    V.check_tensor("outs", outs, 4, V.FLOAT_DTYPES)
    V.check_tensor("lses", lses, 3, (torch.float32,), outs.device)
    if tuple(lses.shape) != tuple(outs.shape[:3]):
        raise ValueError(
            f"lses has shape {tuple(lses.shape)}; expected {tuple(outs.shape[:3])} (S, N, H of outs)"
        )
    S, N, H, L = outs.shape
    if S == 0 or L == 0:
        raise ValueError(f"lse_merge needs S >= 1 partials of width L >= 1; got outs {tuple(outs.shape)}")
    out = torch.empty((N, H, L), dtype=outs.dtype, device=outs.device)
    lse = torch.empty((N, H), dtype=torch.float32, device=outs.device)
    _merge_into(outs, lses, out, lse)
    return out, lse


def lse_merge_ref(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of ``lse_merge`` (fp32 math)."""
    lse = torch.logsumexp(lses.float(), dim=0)  # (N, H); -inf where every partial is -inf
    finite = torch.isfinite(lse)
    weights = torch.exp(lses.float() - torch.where(finite, lse, 0.0)[None])  # (S, N, H)
    weights = torch.where(torch.isfinite(lses), weights, 0.0)
    parts = torch.where(torch.isfinite(lses)[..., None], outs.float(), 0.0)
    out = (weights[..., None] * parts).sum(0)  # (N, H, L)
    return out.to(outs.dtype), lse
