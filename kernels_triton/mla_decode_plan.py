"""The balanced split plan of ``mla_decode`` (``config["balanced"]``): one launch, before the
attention kernel, that gives every program its request and token range from ``seq_lens`` on
the device (no host sync; graph-safe). See ``mla_decode.py``'s docstring for the design."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import triton
import triton.language as tl

from splash.kernels_triton.pdl import pdl_enter


@triton.jit
def _balanced_split(seq_lens_ptr, stride_sl, N, P, p, meta_ptr, write_meta, MIN_TILES,
                    BLOCK_N: tl.constexpr):
    """Program ``p``'s share of a batch split by its total work: with T tiles over all N
    requests, request i gets s_i = max(ceil(t_i / W), 1) splits of equal tiles, W being the
    fewest tiles a split (at least MIN_TILES) for which the s_i sum to at most P, found by
    bisection between ceil(T / P) and ceil(T / (P - N)) (where the sum is at most P; T when
    P <= N + 1). The splits are numbered request after request, so at most P programs have
    work. Every program derives the same plan from ``seq_lens``; the one with ``write_meta``
    stores the first split of each request and the total (``meta`` (N + 1,)) for the merge.
    Returns (request, or N past the last split; its splits; [start, end))."""
    CH: tl.constexpr = 256
    offs = tl.arange(0, CH)
    total = 0
    for c in range(0, N, CH):
        lens = tl.load(seq_lens_ptr + (c + offs) * stride_sl, mask=c + offs < N, other=0)
        total += tl.sum(tl.cdiv(lens.to(tl.int32), BLOCK_N))
    hi = tl.maximum(tl.cdiv(total, tl.maximum(P - N, 1)), MIN_TILES)
    lo = hi  # P <= N + 1: one split a request (the launcher then holds no partial rows)
    if P > N + 1:
        lo = tl.maximum(tl.cdiv(total, P), MIN_TILES)
    while lo < hi:  # the fewest tiles a split that keeps the splits within P
        mid = (lo + hi) // 2
        splits = 0
        for c in range(0, N, CH):
            lens = tl.load(seq_lens_ptr + (c + offs) * stride_sl, mask=c + offs < N, other=0)
            each = tl.maximum(tl.cdiv(tl.cdiv(lens.to(tl.int32), BLOCK_N), mid), 1)
            splits += tl.sum(tl.where(c + offs < N, each, 0))
        if splits <= P:
            hi = mid
        else:
            lo = mid + 1
    W = lo
    carry = 0  # splits of the requests before this pass
    req = 0  # requests whose splits all come before p
    first = 0  # and their splits: p's request's first split
    for c in range(0, N, CH):
        idx = c + offs
        ok = idx < N
        lens = tl.load(seq_lens_ptr + idx * stride_sl, mask=ok, other=0).to(tl.int32)
        splits = tl.where(ok, tl.maximum(tl.cdiv(tl.cdiv(lens, BLOCK_N), W), 1), 0)
        ends = carry + tl.cumsum(splits, 0)
        if write_meta:
            tl.store(meta_ptr + idx, ends - splits, mask=ok)
        before = ok & (ends <= p)
        req += tl.sum(before.to(tl.int32))
        first += tl.sum(tl.where(before, splits, 0))
        carry += tl.sum(splits)
    if write_meta:
        tl.store(meta_ptr + N, carry)
    # p's request (req < N) again, as scalars
    n_tok = tl.load(seq_lens_ptr + tl.minimum(req, N - 1) * stride_sl).to(tl.int32)
    tiles = tl.cdiv(n_tok, BLOCK_N)
    count = tl.maximum(tl.cdiv(tiles, W), 1)
    per_split = tl.cdiv(tiles, count) * BLOCK_N
    start = (p - first) * per_split
    end = tl.minimum(start + per_split, n_tok)
    return req, count, start, end


@triton.jit(do_not_specialize=["N", "P"])  # vary by step: one binary
def _decode_plan_kernel(seq_lens_ptr, stride_sl, N, P, MIN_TILES, items_ptr, meta_ptr,
                        BLOCK_N: tl.constexpr, PDL: tl.constexpr = False):
    """Balanced splits, planned once per launch: program p stores its (request, splits, start,
    end) at ``items[4p:4p + 4]`` (request N: no work); program 0 also stores ``meta``. Kept out
    of the attention kernel, whose registers it would crowd."""
    pdl_enter(PDL)
    p = tl.program_id(0)
    req, count, start, end = _balanced_split(seq_lens_ptr, stride_sl, N, P, p, meta_ptr, p == 0,
                                             MIN_TILES, BLOCK_N)
    item = items_ptr + p * 4
    tl.store(item, req)
    tl.store(item + 1, count)
    tl.store(item + 2, start)
    tl.store(item + 3, end)


# ---------------------------------------------------------------------------------------------
# one plan per forward

_scope = threading.local()


@contextlib.contextmanager
def plan_scope() -> Iterator[None]:
    """Within it, ``mla_decode`` plans balanced splits once per (``seq_lens`` tensor, its
    version, launch shape) and later launches reuse the plan: the layers of one forward share
    their lengths, so a step (or the CUDA graph captured from it) holds one plan launch instead
    of one a layer. Plans live until the outermost scope exits; nested scopes share it."""
    outer = getattr(_scope, "plans", None)
    if outer is None:
        _scope.plans = {}
    try:
        yield
    finally:
        if outer is None:
            _scope.plans = None


def planned(seq_lens: torch.Tensor, key: tuple, make: Callable[[], Any]) -> Any:
    """``make()``'s plan for ``seq_lens`` and ``key``, reused inside a ``plan_scope`` while the
    same tensor object is unchanged (its version counter; inference tensors keep none, and a
    forward does not write its lengths); outside a scope, ``make()``."""
    plans = getattr(_scope, "plans", None)
    if plans is None:
        return make()
    try:
        version = seq_lens._version
    except RuntimeError:  # an inference tensor (torch.inference_mode)
        version = None
    full = (id(seq_lens), version, *key)
    hit = plans.get(full)
    if hit is not None and hit[0] is seq_lens:
        return hit[1]
    value = make()
    plans[full] = (seq_lens, value)  # the reference keeps the id from being reused
    return value
