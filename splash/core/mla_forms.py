"""The two forms of MLA attention over a prefill chunk, priced in FLOPs per head: absorbed (the
query through W_UK and the output through W_UV, (2L + R) dims per (row, key) pair) and expanded
(every history row turned into per-head keys and values through W_UK and W_UV, then nope + R + v
dims per pair). The engine runs each chunk in the faster form and the cost model prices it so;
both read this module."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# FLOPs of the expanded form run this much faster than the absorbed kernel's: measured on an
# H200 at 64-8K-row chunks over 0-32K histories, 1.5-2.6× (the expansion is a dense GEMM;
# benchmarks/results/h200/expanded_prefill_small.json); the smallest seen
EXPANDED_SPEED = 1.5


def causal_pairs(q: int, k: int) -> int:
    """(row, key) pairs of ``q`` query rows, the last of ``k`` history rows, causally."""
    return q * k - q * (q - 1) // 2


def form_flops(cfg: Any, q_lens: Sequence[int], kv_lens: Sequence[int]) -> tuple[int, int]:
    """(absorbed, expanded) multiply-adds per head of requests of ``q_lens`` query rows over
    ``kv_lens`` history rows each (the chunk included), projections of either form included."""
    L, R = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    DN, DV = cfg.qk_nope_head_dim, cfg.v_head_dim
    pairs = sum(causal_pairs(q, k) for q, k in zip(q_lens, kv_lens))
    absorbed = pairs * (2 * L + R) + sum(q_lens) * L * (DN + DV)
    expanded = pairs * (DN + R + DV) + sum(kv_lens) * L * (DN + DV)
    return absorbed, expanded


def expanded_wins(cfg: Any, q_lens: Sequence[int], kv_lens: Sequence[int]) -> bool:
    """Whether the expanded form is faster: its FLOPs, at ``EXPANDED_SPEED`` times the absorbed
    rate, take less time."""
    absorbed, expanded = form_flops(cfg, q_lens, kv_lens)
    return expanded < absorbed * EXPANDED_SPEED
