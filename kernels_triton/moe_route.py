"""MoE routing in one kernel: router logits -> the experts each token goes to, and their weights.

DeepSeek's routers, as transformers computes them:

- ``softmax`` scores (V2) or ``sigmoid`` scores (V3 family, ``noaux_tc``);
- the choice is the score, plus a correction bias under ``noaux_tc``;
- with groups (``group_limited_greedy``, ``noaux_tc``), each group is scored by its best choice
  or, under ``noaux_tc``, by the sum of its two best; only the ``topk_group`` best groups stay
  (the others' choices become 0, or -inf under ``noaux_tc``);
- the top ``k`` choices are the experts, best first; their weights are the unbiased scores
  under ``noaux_tc``, else the (masked) choices; optionally normalised to sum 1; then scaled.

In torch this is a dozen small kernels per MoE layer (softmax or sigmoid, the bias, group
top-2, group top-k, scatter, repeat, mask, top-k, gather, normalise, scale). One program here
routes one token: every selection is an argmax, ties to the lowest index.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splash.kernels_triton import _validate as V

_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@triton.jit
def _moe_route_kernel(
    logits_ptr,  # (N, E) fp32
    bias_ptr,  # (E,) fp32 (HAS_BIAS)
    w_ptr,  # (N, K) fp32
    ids_ptr,  # (N, K) int64
    E,
    stride_l, stride_w, stride_i,
    scale,
    SOFTMAX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NOAUX: tl.constexpr,  # noaux_tc: group score = top-2 sum, masked choices -inf, raw weights
    GROUPS: tl.constexpr,  # 1: no group limit
    GROUP_SIZE: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    K: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < E
    logit = tl.load(logits_ptr + row * stride_l + offs, mask=valid, other=float("-inf"))
    if SOFTMAX:
        ex = tl.exp(logit - tl.max(logit, axis=0))
        scores = ex / tl.sum(ex, axis=0)
    else:
        scores = tl.where(valid, 1.0 / (1.0 + tl.exp(-logit)), 0.0)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + offs, mask=valid, other=0.0)
    neg = float("-inf")
    choice = tl.where(valid, choice, neg)
    if GROUPS > 1:
        group = offs // GROUP_SIZE
        offs_g = tl.arange(0, BLOCK_G)
        gscore = tl.full((BLOCK_G,), neg, tl.float32)
        for g in tl.static_range(GROUPS):
            in_g = (group == g) & valid
            c = tl.where(in_g, choice, neg)
            best = tl.max(c, axis=0)
            s = best
            if NOAUX:  # plus the second best (the best's first occurrence left out)
                first = tl.argmax(c, axis=0, tie_break_left=True)
                s = best + tl.max(tl.where(offs == first, neg, c), axis=0)
            gscore = tl.where(offs_g == g, s, gscore)
        keep = offs < 0  # all False
        for _ in tl.static_range(TOPK_GROUP):
            pick = tl.argmax(gscore, axis=0, tie_break_left=True)
            keep = keep | (group == pick)
            gscore = tl.where(offs_g == pick, neg, gscore)
        masked = neg if NOAUX else 0.0
        choice = tl.where(keep & valid, choice, tl.where(valid, masked, neg))
    source = scores if NOAUX else choice
    offs_k = tl.arange(0, BLOCK_K)
    ws = tl.zeros((BLOCK_K,), tl.float32)
    idv = tl.zeros((BLOCK_K,), tl.int64)
    for j in tl.static_range(K):
        pick = tl.argmax(choice, axis=0, tie_break_left=True)
        ws = tl.where(offs_k == j, tl.sum(tl.where(offs == pick, source, 0.0), axis=0), ws)
        idv = tl.where(offs_k == j, pick.to(tl.int64), idv)
        choice = tl.where(offs == pick, neg, choice)
    if NORM:
        ws = ws / (tl.sum(ws, axis=0) + 1e-20)
    mask_k = offs_k < K
    tl.store(w_ptr + row * stride_w + offs_k, ws * scale, mask=mask_k)
    tl.store(ids_ptr + row * stride_i + offs_k, idv, mask=mask_k)


def _check(logits: torch.Tensor, bias: torch.Tensor | None, method: str, groups: int,
           topk_group: int, k: int) -> None:
    V.check_tensor("logits", logits, 2, (torch.float32,))
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
    e = logits.shape[1]
    if bias is not None:
        V.check_tensor("bias", bias, 1, (torch.float32,), logits.device)
        V.check_dim("bias", bias, 0, e, "one per expert")
    if groups < 1 or e % groups:
        raise ValueError(f"{e} experts do not split into {groups} groups")
    if method != "greedy" and groups > 1 and not 1 <= topk_group <= groups:
        raise ValueError(f"topk_group {topk_group} must lie in [1, {groups}]")
    if not 1 <= k <= e:
        raise ValueError(f"k = {k} experts per token must lie in [1, {e}]")


def moe_route(logits: torch.Tensor, bias: torch.Tensor | None, scoring: str, method: str,
              groups: int, topk_group: int, k: int, norm: bool,
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (N, E) fp32 -> (weights (N, k) fp32, expert ids (N, k) int64), best first."""
    _check(logits, bias, method, groups, topk_group, k)
    n, e = logits.shape
    weights = torch.empty((n, k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((n, k), dtype=torch.int64, device=logits.device)
    if n == 0:
        return weights, ids
    grouped = method != "greedy" and groups > 1
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    _moe_route_kernel[(n,)](
        logits, bias if bias is not None else logits, weights, ids, e,
        logits.stride(0), weights.stride(0), ids.stride(0), float(scale),
        SOFTMAX=scoring == "softmax", HAS_BIAS=bias is not None, NOAUX=method == "noaux_tc",
        GROUPS=groups if grouped else 1, GROUP_SIZE=e // groups if grouped else e,
        TOPK_GROUP=topk_group if grouped else 1, K=k, NORM=bool(norm),
        BLOCK_E=V.next_pow2(e), BLOCK_G=V.next_pow2(groups if grouped else 1, 2),
        BLOCK_K=V.next_pow2(k, 2), num_warps=1)
    return weights, ids


def moe_route_ref(logits: torch.Tensor, bias: torch.Tensor | None, scoring: str, method: str,
                  groups: int, topk_group: int, k: int, norm: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: transformers' DeepSeek routing (see the module docstring)."""
    scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias
    n, num_experts = logits.shape
    if method != "greedy" and groups > 1:
        grouped = choice.view(n, groups, num_experts // groups)  # (N, G, E/G)
        if method == "noaux_tc":
            group_score = grouped.topk(2, dim=-1).values.sum(-1)
        else:
            group_score = grouped.max(dim=-1).values
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(topk_group, dim=-1).indices, True)
        keep = keep.repeat_interleave(num_experts // groups, dim=1)  # (N, E)
        choice = choice.masked_fill(~keep, float("-inf") if method == "noaux_tc" else 0.0)
    ids = choice.topk(k, dim=-1).indices
    weights = (scores if method == "noaux_tc" else choice).gather(1, ids)
    if norm:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scale, ids
