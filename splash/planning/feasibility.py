"""Which layouts fit the memory budget, and which switches fit the headroom (docs/design.md §5).

Per-rank bytes = common + projections (1/T if sharded) + KV pages the rank holds + reserve, where
``reserve`` covers activation scratch, graphs and allocator slack. A switch additionally holds one
layer's transfer buffers beyond max(source, destination) (paper §4.2, Appendix G).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from splash.core.memory import MemoryModel
from splash.core.ownership import (
    LAYOUTS,
    KVPlacement,
    Layout,
    get_layout,
    held_tokens,
    kv_capacity_tokens,
)

FIXED_RESERVE_BYTES = 1 << 30  # graphs + allocator slack at full scale (paper B.1: 1 GiB)
ACT_BYTES = 2  # activations are bf16


def default_reserve_bytes(cfg, world: int, max_rows: int = 8192, fixed: int | None = None) -> int:
    """Activation scratch of a ``max_rows``-row step plus a fixed reserve (bytes per rank)."""
    c = cfg
    d = c.kv_lora_rank + c.qk_rope_head_dim
    inter = max(c.intermediate_size, (c.num_experts_per_tok or 0) * (c.moe_intermediate_size or 0))
    per_row = ACT_BYTES * (8 * c.hidden_size + 2 * c.num_attention_heads * d + 3 * inter // world)
    return max_rows * per_row + (FIXED_RESERVE_BYTES if fixed is None else fixed)


@dataclass(frozen=True)
class Feasibility:
    """Memory checks over one ``MemoryModel``; ``aux_kv_bytes_per_token_per_layer`` adds state
    that lives and moves with each KV row but that MemoryModel does not count (DSA indexer keys)."""

    memory: MemoryModel
    reserve_bytes: int = 0
    aux_kv_bytes_per_token_per_layer: int = 0
    _static: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.reserve_bytes < 0 or self.aux_kv_bytes_per_token_per_layer < 0:
            raise ValueError("reserve and aux KV bytes must be >= 0")
        static = {n: self.memory.static_bytes_per_rank(lay) for n, lay in LAYOUTS.items()}
        object.__setattr__(self, "_static", static)  # MemoryModel recomputes it per call

    def static_bytes(self, layout: str | Layout) -> int:
        """Common + projection bytes per rank (no KV, no reserve)."""
        return self._static[layout if isinstance(layout, str) else layout.name]

    @property
    def kv_bytes_per_token(self) -> int:
        m = self.memory
        return (m.kv_bytes_per_token_per_layer + self.aux_kv_bytes_per_token_per_layer) * \
            m.cfg.num_hidden_layers

    def held_tokens(self, layout: str | Layout, tokens: Sequence[int] | np.ndarray,
                    owners: Sequence[int] | None = None) -> np.ndarray:
        """Page-rounded KV tokens each rank holds under ``layout``, shape (T,)."""
        lay = get_layout(layout) if isinstance(layout, str) else layout
        own = None if owners is None else np.asarray(owners, np.int64)
        return held_tokens(lay, np.asarray(tokens), own, self.memory.world, self.memory.page_size)

    def per_rank_bytes(self, layout: str | Layout, tokens: Sequence[int] | np.ndarray,
                       owners: Sequence[int] | None = None) -> int:
        """Bytes the busiest rank needs for ``layout`` holding these live requests."""
        lay = get_layout(layout) if isinstance(layout, str) else layout
        kv = int(self.held_tokens(lay, tokens, owners).max()) * self.kv_bytes_per_token
        return self._static[lay.name] + kv + self.reserve_bytes

    def feasible(self, layout: str | Layout, tokens: Sequence[int] | np.ndarray,
                 budget_bytes: int, owners: Sequence[int] | None = None) -> bool:
        return self.per_rank_bytes(layout, tokens, owners) <= budget_bytes

    def kv_capacity_tokens(self, layout: str | Layout, budget_bytes: int) -> int:
        """Distinct KV tokens the group can hold under ``layout`` (page-rounded)."""
        lay = get_layout(layout) if isinstance(layout, str) else layout
        room = budget_bytes - self._static[lay.name] - self.reserve_bytes
        pages = room // (self.kv_bytes_per_token * self.memory.page_size)
        return kv_capacity_tokens(lay, pages, self.memory.page_size, self.memory.world)

    def switch_buffer_bytes(self, src: str, dst: str, tokens: Sequence[int] | np.ndarray,
                            owners: Sequence[int] | None = None) -> int:
        """One layer's transfer buffer on the busiest rank for a src → dst switch."""
        s, d = get_layout(src), get_layout(dst)
        m, T = self.memory, self.memory.world
        if s == d or T == 1:
            return 0
        weights = m.weight_allgather_bytes_per_rank_per_layer if (
            s.shards_heads and not d.shards_heads) else 0
        kv_tokens = 0
        if s.kv != d.kv and s.kv is not KVPlacement.REPLICATED:
            held_s = self.held_tokens(s, tokens, owners)
            held_d = self.held_tokens(d, tokens, owners)
            if d.kv is KVPlacement.REPLICATED:
                kv_tokens = int((held_d - held_s).max())
            else:
                kv_tokens = int(held_d.max())  # receive buffer, sized for the whole layer
        per_tok = m.kv_bytes_per_token_per_layer + self.aux_kv_bytes_per_token_per_layer
        return weights + kv_tokens * per_tok

    def switch_feasible(self, src: str, dst: str, tokens: Sequence[int] | np.ndarray,
                        budget_bytes: int, owners: Sequence[int] | None = None) -> bool:
        """Headroom rule: max(src, dst) + one layer's transfer buffer must fit."""
        peak = max(self.per_rank_bytes(src, tokens, owners), self.per_rank_bytes(dst, tokens, owners))
        return peak + self.switch_buffer_bytes(src, dst, tokens, owners) <= budget_bytes
