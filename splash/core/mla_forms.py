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


def request_macs(cfg: Any, q: Any, k: Any) -> tuple[Any, Any]:
    """(absorbed, expanded) multiply-adds per head of a request of ``q`` query rows, the last
    of its ``k`` history rows (causal pairs), projections of either form included; ints, or
    numpy arrays of requests elementwise."""
    L, R = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    DN, DV = cfg.qk_nope_head_dim, cfg.v_head_dim
    pairs = q * k - q * (q - 1) // 2
    return (pairs * (2 * L + R) + q * L * (DN + DV),
            pairs * (DN + R + DV) + k * L * (DN + DV))


def faster_expanded(absorbed: Any, expanded: Any) -> Any:
    """Whether ``expanded`` multiply-adds, at ``EXPANDED_SPEED`` times the absorbed rate, take
    less time than ``absorbed`` (elementwise for arrays)."""
    return expanded < absorbed * EXPANDED_SPEED


def form_flops(cfg: Any, q_lens: Sequence[int], kv_lens: Sequence[int]) -> tuple[int, int]:
    """`request_macs` summed over requests of ``q_lens`` rows over ``kv_lens`` history rows."""
    both = [request_macs(cfg, q, k) for q, k in zip(q_lens, kv_lens)]
    return sum(a for a, _ in both), sum(e for _, e in both)


def expanded_wins(cfg: Any, q_lens: Sequence[int], kv_lens: Sequence[int]) -> bool:
    """Whether the expanded form is faster for these requests together."""
    return bool(faster_expanded(*form_flops(cfg, q_lens, kv_lens)))
