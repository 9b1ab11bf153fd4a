"""The two values the cost model trades in: one step's work (`BatchShape`) and the predicted
cost of a live switch (`SwitchCost`). Plain data, no model or hardware."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BatchShape:
    """One step's work. ``decode_ctx``: per decode row, the KV tokens it attends (its context
    including the new token). ``prefill``: per prefill chunk, (chunk_len, prefix_len). ``owners``:
    optional owner rank per request (decode rows first, then chunks); None = greedy by tokens."""

    decode_ctx: Sequence[int] = ()  # stored as tuples (hashable: the work is memoised)
    prefill: Sequence[tuple[int, int]] = ()
    owners: Sequence[int] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "decode_ctx", tuple(int(c) for c in self.decode_ctx))
        object.__setattr__(self, "prefill", tuple((int(n), int(p)) for n, p in self.prefill))
        if any(c < 1 for c in self.decode_ctx):
            raise ValueError("decode contexts must be >= 1")
        if any(n < 1 or p < 0 for n, p in self.prefill):
            raise ValueError("prefill chunks need chunk_len >= 1 and prefix_len >= 0")
        if self.owners is not None:
            object.__setattr__(self, "owners", tuple(int(o) for o in self.owners))
            if len(self.owners) != self.num_requests or min(self.owners, default=0) < 0:
                raise ValueError("owners needs one rank >= 0 per request")

    @classmethod
    def decode(cls, batch: int, context_len: int) -> BatchShape:
        return cls(decode_ctx=(context_len,) * batch)

    @property
    def num_requests(self) -> int:
        return len(self.decode_ctx) + len(self.prefill)

    @property
    def num_rows(self) -> int:
        return len(self.decode_ctx) + sum(n for n, _ in self.prefill)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(rows, prefix) per request as int64 arrays."""
        rows = np.array([1] * len(self.decode_ctx) + [n for n, _ in self.prefill], dtype=np.int64)
        prefix = np.array([c - 1 for c in self.decode_ctx] + [p for _, p in self.prefill],
                          dtype=np.int64)
        return rows, prefix

    def tokens_after(self) -> np.ndarray:
        """KV tokens each request holds once this step has written its rows."""
        rows, prefix = self.arrays()
        return rows + prefix


@dataclass(frozen=True)
class SwitchCost:
    """Predicted cost of one live switch at a step boundary (bytes: the busiest rank)."""

    src: str
    dst: str
    primitives: tuple[str, ...]  # e.g. ("weight all-gather", "kv all-to-all"); () = discards
    weight_bytes_per_rank_per_layer: int
    kv_bytes_per_rank_per_layer: int
    transfer_ms_per_layer: float
    live_ms: float  # layer-pipelined: only what compute cannot hide, plus the first layer
    blocking_ms: float  # move everything, then compute
