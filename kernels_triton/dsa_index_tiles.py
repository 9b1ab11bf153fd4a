"""The lightning indexer's per-tile pieces (``dsa_index``): a key tile's page ids, its score
column factor, its keys in the product's dtype, and its head-weighted relu scores with the
maxima of their groups."""

from __future__ import annotations

import triton
import triton.language as tl

from splash.kernels_triton.paged_ids import _gather_page_ids


@triton.jit
def _tile_pages(bt_row, pages, first_page, t0, lim, stride_btp, PAGE_SIZE: tl.constexpr,
                BLOCK_T: tl.constexpr, PAGES: tl.constexpr):
    """Tile [t0, t0 + BLOCK_T)'s tokens (those < ``lim`` held), their page ids and rows in the
    page. With PAGES > 0 the ids come from ``pages``, the program's PAGES ids from
    ``first_page`` on (a gather in registers, not a load: see the module docstring)."""
    offs_t = t0 + tl.arange(0, BLOCK_T)
    mask_t = offs_t < lim
    if PAGES > 0:
        page = tl.where(mask_t, _gather_page_ids(pages, first_page, offs_t, PAGE_SIZE, PAGES), 0)
    else:
        page = tl.load(bt_row + (offs_t // PAGE_SIZE) * stride_btp, mask=mask_t, other=0)
    return page.to(tl.int64), offs_t % PAGE_SIZE, mask_t


@triton.jit
def _tile_col(ks_ptr, page, slot, mask_t, softmax_scale, stride_sp, stride_ss,
              BLOCK_T: tl.constexpr, IS_FP8: tl.constexpr):
    """A tile's score-column factor: the softmax scale x the fp8 key scale."""
    col = tl.full((BLOCK_T,), 1.0, tl.float32) * softmax_scale
    if IS_FP8:
        col = col * tl.load(ks_ptr + page * stride_sp + slot * stride_ss, mask=mask_t, other=0.0)
    return col


@triton.jit
def _tile_keys(k_ptr, page, slot, mask_t, stride_kp, stride_ks, stride_kd, q_dtype: tl.constexpr,
               I: tl.constexpr, BLOCK_I: tl.constexpr, IS_FP8: tl.constexpr,
               FP8_DOT: tl.constexpr):
    """A tile's keys (0 past ``mask_t``) in the product's dtype."""
    offs_i = tl.arange(0, BLOCK_I)
    k = tl.load(k_ptr + (page * stride_kp + slot * stride_ks)[:, None] + offs_i[None, :] * stride_kd,
                mask=mask_t[:, None] & (offs_i < I)[None, :], other=0.0)
    if IS_FP8 and not FP8_DOT:
        k = k.to(q_dtype)  # exact: fp8 values fit fp16 / bf16 / fp32
    return k


@triton.jit
def _tile_scores(q, w, k, col, t0, pos, mask_m, out_rows, T, stride_ot, max_rows, stride_og,
                 BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
                 TOKENS_M: tl.constexpr, DOT_PRECISION: tl.constexpr, GROUP: tl.constexpr):
    """The head-weighted relu sum of one key tile against the rows' queries, stored (tokens
    past a row's position -inf), with the maximum of each ``GROUP`` tokens (GROUP > 0)."""
    offs_t = t0 + tl.arange(0, BLOCK_T)
    if TOKENS_M:  # tokens on the product's M side: heads fold within a thread's row
        s = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # (BLOCK_T, BM*BH)
        s = tl.maximum(s * col[:, None], 0.0) * w[None, :]
        if BLOCK_M == 1:
            score = tl.sum(s, axis=1)[None, :]
        else:
            score = tl.trans(tl.sum(tl.reshape(s, (BLOCK_T, BLOCK_M, BLOCK_H)), axis=2))
    else:
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BM*BH, BLOCK_T)
        s = tl.maximum(s * col[None, :], 0.0) * w[:, None]
        if BLOCK_M == 1:  # decode: fold the heads without a reshape
            score = tl.sum(s, axis=0)[None, :]
        else:
            score = tl.sum(tl.reshape(s, (BLOCK_M, BLOCK_H, BLOCK_T)), axis=1)
    score = tl.where(offs_t[None, :] <= pos[:, None], score, float("-inf"))
    tl.store(out_rows + offs_t[None, :] * stride_ot, score,
             mask=mask_m[:, None] & (offs_t < T)[None, :])
    _store_maxima(score, t0, mask_m, max_rows, T, stride_og, BLOCK_M, BLOCK_T, GROUP)


@triton.jit
def _store_maxima(score, t0, mask_m, max_rows, T, stride_og, BLOCK_M: tl.constexpr,
                  BLOCK_T: tl.constexpr, GROUP: tl.constexpr):
    """The maxima of a tile's ``GROUP``-token groups (nothing where GROUP is 0)."""
    if GROUP > 0:
        NG: tl.constexpr = BLOCK_T // GROUP
        gmax = tl.max(tl.reshape(score, (BLOCK_M, NG, GROUP)), axis=2)
        offs_g = t0 // GROUP + tl.arange(0, NG)
        tl.store(max_rows + offs_g[None, :] * stride_og, gmax,
                 mask=mask_m[:, None] & (offs_g < tl.cdiv(T, GROUP))[None, :])
