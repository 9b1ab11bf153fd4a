"""Per-rank memory and KV capacity of each layout (docs/design.md §1), from model dimensions alone.

The same accounting feeds `splash plan`, the layout policy's feasible set, the engine's page
budget per layout, and the switch manifests' predicted weight bytes.
Per-rank memory = common + projections × (1/T if sharded) + KV(tokens held) + scratch + reserve.
A token's KV is its latent row in every layer plus, in DSA models, its indexer key (and fp8
scale) in every layer that runs an indexer: both live in the same page.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from splash.core.dtypes import dtype_bytes
from splash.core.ownership import LAYOUTS, Layout, ProjPlacement, kv_capacity_tokens


@dataclass(frozen=True)
class MemoryModel:
    """Byte accounting for one model on ``world`` ranks. ``cfg`` is a ModelConfig (HF names)."""

    cfg: Any
    world: int
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    page_size: int = 64
    index_dtype: str = "fp8"  # DSA indexer keys (fp8: one fp32 scale per key)

    def __post_init__(self) -> None:
        if self.world < 1:
            raise ValueError("world must be >= 1")

    # -- weights ---------------------------------------------------------------------------
    @property
    def _wb(self) -> int:
        return dtype_bytes(self.weight_dtype)

    @property
    def projection_params_per_layer(self) -> int:
        c = self.cfg
        heads = c.num_attention_heads
        q_in = c.q_lora_rank if c.q_lora_rank else c.hidden_size
        q_b = q_in * heads * (c.qk_nope_head_dim + c.qk_rope_head_dim)
        kv_b = c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim)
        o = heads * c.v_head_dim * c.hidden_size
        return q_b + kv_b + o

    @property
    def projection_bytes_per_layer(self) -> int:
        """Q-B + KV-B + O of one layer, all heads (DeepSeek-V3 BF16: 328 MiB)."""
        return self.projection_params_per_layer * self._wb

    @property
    def weight_allgather_bytes_per_rank_per_layer(self) -> int:
        """Bytes one rank receives per layer going sharded → replicated (V3, T=8: 287 MiB)."""
        return self.projection_bytes_per_layer * (self.world - 1) // self.world

    def _mlp_params(self, layer: int) -> int:
        c = self.cfg
        if c.is_moe_layer(layer):
            experts = c.n_routed_experts + (c.n_shared_experts or 0)
            return experts * 3 * c.hidden_size * c.moe_intermediate_size
        return 3 * c.hidden_size * c.intermediate_size

    @property
    def common_bytes_per_rank(self) -> int:
        """State no layout changes: embeddings, lm_head, norms, q_a/kv_a, router, MLP/MoE
        shard (1/T), as this engine places it (embeddings and lm_head replicated)."""
        c = self.cfg
        params = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
        per_layer_repl = 2 * c.hidden_size + c.hidden_size * (c.kv_lora_rank + c.qk_rope_head_dim)
        per_layer_repl += c.kv_lora_rank
        if c.q_lora_rank:
            per_layer_repl += c.hidden_size * c.q_lora_rank + c.q_lora_rank
        mlp = 0
        for layer in range(c.num_hidden_layers):
            mlp += self._mlp_params(layer)
            if c.is_moe_layer(layer):
                per_layer_repl_router = c.n_routed_experts * c.hidden_size
                params += per_layer_repl_router
        params += c.num_hidden_layers * per_layer_repl + c.hidden_size
        return params * self._wb + mlp * self._wb // self.world + self._indexer_bytes

    @property
    def _indexer_bytes(self) -> int:
        """DSA indexers, replicated: wq_b, wk, k_norm in the weight dtype; weights_proj fp32."""
        c = self.cfg
        if not getattr(c, "is_dsa", False):
            return 0
        heads, dim = c.index_n_heads, c.index_head_dim
        per_layer = (c.q_lora_rank * heads * dim + c.hidden_size * dim + 2 * dim) * self._wb
        per_layer += c.hidden_size * heads * 4
        return per_layer * c.num_indexer_layers

    def projection_bytes_per_rank(self, layout: Layout) -> int:
        total = self.projection_bytes_per_layer * self.cfg.num_hidden_layers
        return total // self.world if layout.projections is ProjPlacement.SHARDED else total

    def static_bytes_per_rank(self, layout: Layout) -> int:
        return self.common_bytes_per_rank + self.projection_bytes_per_rank(layout)

    # -- KV --------------------------------------------------------------------------------
    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        """One latent row (L + R) of one layer, plus its fp8 scale (V3 BF16: 1,152 B)."""
        c = self.cfg
        scale = 4 if dtype_bytes(self.kv_dtype) == 1 else 0
        return (c.kv_lora_rank + c.qk_rope_head_dim) * dtype_bytes(self.kv_dtype) + scale

    @property
    def index_bytes_per_token_per_layer(self) -> int:
        """One DSA indexer key of one indexer layer, plus its fp8 scale (V3.2, fp8: 132 B)."""
        c = self.cfg
        if not getattr(c, "is_dsa", False):
            return 0
        scale = 4 if dtype_bytes(self.index_dtype) == 1 else 0
        return c.index_head_dim * dtype_bytes(self.index_dtype) + scale

    @property
    def kv_bytes_per_token(self) -> int:
        """Every layer's latent row and every indexer layer's key of one token."""
        index_layers = getattr(self.cfg, "num_indexer_layers", 0)
        return self.kv_bytes_per_token_per_layer * self.cfg.num_hidden_layers + \
            self.index_bytes_per_token_per_layer * index_layers

    @property
    def page_bytes(self) -> int:
        """One page of every layer (pages are allocated for all layers at once)."""
        return self.kv_bytes_per_token * self.page_size

    def kv_pages_per_rank(self, layout: Layout, budget_bytes: int, reserve_bytes: int = 0) -> int:
        room = budget_bytes - self.static_bytes_per_rank(layout) - reserve_bytes
        return max(room // self.page_bytes, 0)

    def kv_capacity_tokens(self, layout: Layout, budget_bytes: int, reserve_bytes: int = 0) -> int:
        """Distinct KV tokens the whole group can hold under ``layout``."""
        pages = self.kv_pages_per_rank(layout, budget_bytes, reserve_bytes)
        return kv_capacity_tokens(layout, pages, self.page_size, self.world)

    def capacity_report(self, budget_bytes: int, reserve_bytes: int = 0) -> dict[str, int]:
        return {
            name: self.kv_capacity_tokens(lay, budget_bytes, reserve_bytes)
            for name, lay in LAYOUTS.items()
        }

    def per_rank_bytes(self, layout: Layout, kv_tokens_on_rank: int) -> int:
        return self.static_bytes_per_rank(layout) + kv_tokens_on_rank * self.kv_bytes_per_token
