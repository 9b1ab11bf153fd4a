"""The DSA lightning indexer of one layer (DeepSeek-V3.2, GLM-5): which `index_topk` history
positions each query attends.

Common state (every rank holds it whole, no layout moves it): `wq_b (HI·I, q_lora)` on the q
LoRA latent, `wk (I, hidden)` with a LayerNorm (`k_norm`, weight and bias, eps 1e-6) on the
hidden state, and `weights_proj (HI, hidden)` (kept in fp32, as transformers keeps it). RoPE
turns the first `qk_rope_head_dim` dims of keys and queries (half split in deepseek_v32,
interleaved in glm_moe_dsa; the rest pass). Per query row and history token t:

    score[t] = sum_h w[h] · relu(I^-0.5 · q[h] · k[t]),   w = weights_proj(x) · HI^-0.5

and the row attends the `index_topk` best positions it sees (all of them when it sees fewer).
The key is stored per token beside the latent KV row (`splash.layouts.base.KVStore`); scoring and
selection run in the Triton kernels `index_scores` and `topk_rows`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from splash.model.config import ModelConfig
from splash.model.loader import take
from splash.model.rope import RotaryEmbedding

K_NORM_EPS = 1e-6


class Indexer:
    """Contract (N rows on this rank):
    - `key(x (N, hidden), positions (N,)) -> (N, I)`: the indexer key to store per token;
    - `query(q_in (N, q_lora), positions) -> (N, HI, I)` from the q LoRA latent (`q_input`);
    - `head_weights(x) -> (N, HI)` fp32, already scaled by HI^-0.5;
    - `softmax_scale` (I^-0.5) and `topk` (`index_topk`).
    """

    def __init__(self, cfg: ModelConfig, tensors: Mapping[str, torch.Tensor],
                 rope: RotaryEmbedding) -> None:
        self.num_heads = int(cfg.index_n_heads or 0)
        self.head_dim = int(cfg.index_head_dim or 0)
        self.topk = int(cfg.index_topk or 0)
        self.rope_dim = cfg.qk_rope_head_dim
        self.softmax_scale = self.head_dim ** -0.5
        self.rope = rope
        self.wq_b = tensors["wq_b"]  # (HI*I, q_lora)
        self.wk = tensors["wk"]  # (I, hidden)
        self.k_norm_weight, self.k_norm_bias = tensors["k_norm_weight"], tensors["k_norm_bias"]
        self.weights_proj = tensors["weights_proj"]  # (HI, hidden) fp32

    @classmethod
    def from_weights(cls, cfg: ModelConfig, weights: Mapping[str, torch.Tensor], prefix: str,
                     rope: RotaryEmbedding, dtype: torch.dtype | None = None,
                     device: torch.device | str | None = None) -> Indexer:
        """The tensors under `prefix` (e.g. `model.layers.3.self_attn.indexer.`)."""

        def get(name: str, keep_fp32: bool = False) -> torch.Tensor:
            t = take(weights, prefix + name)
            want = torch.float32 if keep_fp32 else (dtype or t.dtype)
            return t.to(device=device, dtype=want).contiguous()

        return cls(cfg, {"wq_b": get("wq_b.weight"), "wk": get("wk.weight"),
                         "k_norm_weight": get("k_norm.weight"), "k_norm_bias": get("k_norm.bias"),
                         "weights_proj": get("weights_proj.weight", keep_fp32=True)}, rope)

    def load_weight(self, weights: Mapping[str, torch.Tensor], name: str, prefix: str) -> bool:
        """Copy the new value of HF tensor ``prefix + name`` in place (replicated tensors)."""
        attr = {"wq_b.weight": "wq_b", "wk.weight": "wk", "k_norm.weight": "k_norm_weight",
                "k_norm.bias": "k_norm_bias", "weights_proj.weight": "weights_proj"}.get(name)
        if attr is None:
            return False
        getattr(self, attr).copy_(take(weights, prefix + name))
        return True

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        R = self.rope_dim
        return torch.cat((self.rope(x[..., :R], positions), x[..., R:]), dim=-1)

    def key(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        k = F.layer_norm(x @ self.wk.t(), (self.head_dim,), self.k_norm_weight, self.k_norm_bias,
                         K_NORM_EPS)  # (N, I)
        return self._rope(k, positions)

    def query(self, q_in: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q = (q_in @ self.wq_b.t()).view(-1, self.num_heads, self.head_dim)  # (N, HI, I)
        return self._rope(q, positions)

    def head_weights(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() @ self.weights_proj.t()) * self.num_heads ** -0.5  # (N, HI) fp32
