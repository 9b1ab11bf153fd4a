"""Absorbed Multi-head Latent Attention projections for a held range of heads.

State is split in two (docs/internals.md §3):
- **common** (every rank, never moved): q_a_proj + q_a_layernorm (or nothing when q_proj is
  used), kv_a_proj_with_mqa, kv_a_layernorm;
- **placed** (a head range, moved by layout switches), four head-first tensors:
  `q_b (h, nope+R, q_in)`, `w_uk (h, nope, L)`, `w_uv (h, v, L)`, `w_o (h, v, hidden)`.

Attention itself (softmax over the latent KV history) is not here: layouts run it on what
`latent` and `query` return and hand the latent output back to `output`. DSA layers also carry
their lightning `indexer` (common state, `splash/model/indexer.py`); a DSA layer without one
("shared") attends the positions the previous indexer layer chose.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from splash.errors import ConfigError
from splash.model.config import ModelConfig
from splash.model.indexer import Indexer
from splash.model.loader import take
from splash.model.norm import LATENT_NORM_EPS, rms_norm
from splash.model.rope import RotaryEmbedding

PLACED_NAMES = ("q_b", "w_uk", "w_uv", "w_o")
# HF names (under `self_attn.`) of the common state -> attribute
_COMMON = {"kv_a_proj_with_mqa.weight": "kv_a_proj", "kv_a_layernorm.weight": "kv_a_layernorm",
           "q_a_proj.weight": "q_a_proj", "q_a_layernorm.weight": "q_a_layernorm"}


def _placed_sources(cfg: ModelConfig) -> tuple[str, ...]:
    """HF names (under `self_attn.`) the placed tensors are cut from."""
    q = "q_b_proj.weight" if cfg.q_lora_rank is not None else "q_proj.weight"
    return (q, "kv_b_proj.weight", "o_proj.weight")


def _head_slice(cfg: ModelConfig, weights: Mapping[str, torch.Tensor], name: str, hs: int,
                he: int) -> torch.Tensor:
    """Heads [hs, he) of HF tensor ``name``: rows of the head-major projections, columns of
    o_proj."""
    if name.endswith("o_proj.weight"):
        return take(weights, name, 1, hs * cfg.v_head_dim, he * cfg.v_head_dim)  # (hidden, h*v)
    per = cfg.qk_nope_head_dim + (cfg.v_head_dim if name.endswith("kv_b_proj.weight")
                                  else cfg.qk_rope_head_dim)
    return take(weights, name, 0, hs * per, he * per)


def _place(cfg: ModelConfig, name: str, t: torch.Tensor, h: int) -> dict[str, torch.Tensor]:
    """Placed tensors of ``h`` heads from their slice ``t`` of HF tensor ``name``."""
    nope, L = cfg.qk_nope_head_dim, cfg.kv_lora_rank
    if name.endswith("o_proj.weight"):
        return {"w_o": t.t().reshape(h, cfg.v_head_dim, cfg.hidden_size).contiguous()}
    if name.endswith("kv_b_proj.weight"):
        kv_b = t.view(h, nope + cfg.v_head_dim, L)
        return {"w_uk": kv_b[:, :nope].contiguous(), "w_uv": kv_b[:, nope:].contiguous()}
    return {"q_b": t.view(h, nope + cfg.qk_rope_head_dim, cfg.q_in_dim)}


def _placed(cfg: ModelConfig, weights: Mapping[str, torch.Tensor], prefix: str, hs: int,
            he: int, prep: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """The four placed tensors of heads [hs, he) of one layer (HF names under ``prefix``)."""
    placed: dict[str, torch.Tensor] = {}
    for name in _placed_sources(cfg):
        placed.update(_place(cfg, name, prep(_head_slice(cfg, weights, prefix + name, hs, he)),
                             he - hs))
    return placed


class MLAAttention:
    """MLA projections of one layer for heads [head_start, head_start + num_heads).

    Contract (N rows, all on this rank):
    - `latent(x (N, hidden), positions (N,)) -> (N, L+R)`: normalised c_kv ‖ roped k_rope,
      the KV row to store; independent of the held heads.
    - `query(x, positions) -> (N, h, L+R)`: absorbed query q_nope·W_UK ‖ roped q_rope.
    - `output(o_latent (N, h, L)) -> (N, hidden)`: this head range's share of o_proj's output;
      summing over disjoint head ranges covering all heads gives the full attention output.
    - `sm_scale`: softmax scale including the YaRN mscale.
    - `is_sparse` (DSA) with `indexer` (None on a layer that shares the previous selection).
    """

    def __init__(self, cfg: ModelConfig, common: Mapping[str, torch.Tensor], head_start: int,
                 placed: Mapping[str, torch.Tensor], rope: RotaryEmbedding,
                 indexer: Indexer | None = None) -> None:
        self.cfg, self.rope = cfg, rope
        self.is_sparse = cfg.is_dsa
        self.indexer = indexer
        self.q_a_proj = common.get("q_a_proj")  # (q_lora, hidden) or None
        self.q_a_layernorm = common.get("q_a_layernorm")  # (q_lora,) or None
        self.kv_a_proj = common["kv_a_proj_with_mqa"]  # (L+R, hidden)
        self.kv_a_layernorm = common["kv_a_layernorm"]  # (L,)
        if (self.q_a_proj is None) != (cfg.q_lora_rank is None):
            raise ConfigError("q_a_proj must be given exactly when q_lora_rank is set")
        # keep_placements (set by a worker that replays CUDA graphs): one set of placed tensors
        # per head range ever held, kept for the engine's life, so a layout switch back to a
        # range copies into the same memory and the graphs captured for the layouts of that
        # placement stay valid (paper §G; docs/internals.md §4a). Otherwise only the current
        # range is held and a switch frees the previous one.
        self.keep_placements = False
        self._buffers: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.set_placed(head_start, placed)

    @classmethod
    def from_weights(cls, cfg: ModelConfig, weights: Mapping[str, torch.Tensor], layer_idx: int,
                     head_start: int = 0, num_heads: int | None = None,
                     rope: RotaryEmbedding | None = None, prefix: str | None = None,
                     dtype: torch.dtype | None = None,
                     device: torch.device | str | None = None) -> MLAAttention:
        """Slice HF weights of one layer (names under `prefix`, default
        `model.layers.{layer_idx}.self_attn.`) to heads [head_start, head_start + num_heads)."""
        H = cfg.num_attention_heads
        h = H - head_start if num_heads is None else num_heads
        if not (0 <= head_start and h > 0 and head_start + h <= H):
            raise ConfigError(f"head range [{head_start}, {head_start + h}) outside [0, {H})")
        p = f"model.layers.{layer_idx}.self_attn." if prefix is None else prefix
        hs, he = head_start, head_start + h

        def prep(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype or t.dtype).contiguous()

        common = {name.removesuffix(".weight"): prep(take(weights, p + name)) for name in _COMMON
                  if cfg.q_lora_rank is not None or not name.startswith("q_a")}
        placed = _placed(cfg, weights, p, hs, he, prep)
        indexer = None
        if cfg.has_indexer(layer_idx):
            index_rope = RotaryEmbedding(cfg, device, interleave=cfg.index_rope_interleave)
            indexer = Indexer.from_weights(cfg, weights, p + "indexer.", index_rope, dtype, device)
        return cls(cfg, common, head_start, placed, rope or RotaryEmbedding(cfg, device), indexer)

    def load_weight(self, weights: Mapping[str, torch.Tensor], name: str, prefix: str) -> bool:
        """Copy the new value of HF tensor ``prefix + name`` into the state it feeds, in place
        (every head range held: each placement's slice). False: not an attention tensor."""
        if name in _COMMON:
            t = getattr(self, _COMMON[name])
            if t is None:
                return False
            t.copy_(take(weights, prefix + name))
            return True
        if name.startswith("indexer."):
            return self.indexer is not None and self.indexer.load_weight(
                weights, name.removeprefix("indexer."), prefix + "indexer.")
        if name not in _placed_sources(self.cfg):
            return False
        for (hs, h), buf in self._buffers.items():
            for key, t in _place(self.cfg, name, _head_slice(self.cfg, weights, prefix + name,
                                                               hs, hs + h), h).items():
                buf[key].copy_(t)
        return True

    # --- placement -----------------------------------------------------------------------
    def hold(self, weights: Mapping[str, torch.Tensor], prefix: str, heads: range) -> None:
        """Also hold the placement of ``heads`` (loaded from HF ``weights`` under ``prefix``,
        beside the current one, on the current tensors' device and dtype): a later switch to
        that range changes no byte (`use`). Placements are then kept for the engine's life."""
        self.keep_placements = True
        key = (heads.start, len(heads))
        if key in self._buffers:
            return
        ref = self.q_b

        def prep(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=ref.device, dtype=ref.dtype).contiguous()

        placed = _placed(self.cfg, weights, prefix, heads.start, heads.stop, prep)
        self._buffers[key] = {k: placed[k] for k in PLACED_NAMES}

    def holds(self, heads: range) -> bool:
        """Whether the placement of ``heads`` is held (current or kept)."""
        return (heads.start, len(heads)) in self._buffers

    def use(self, heads: range) -> None:
        """Compute with the held placement of ``heads`` from now on (no copy)."""
        self.set_placed(heads.start, self._buffers[(heads.start, len(heads))])

    def placed_weights(self) -> dict[str, torch.Tensor]:
        """The four head-first tensors this instance holds (no copies)."""
        return {"q_b": self.q_b, "w_uk": self.w_uk, "w_uv": self.w_uv, "w_o": self.w_o}

    def set_placed(self, head_start: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Hold heads [head_start, head_start + h) given their four placed tensors."""
        cfg = self.cfg
        h = tensors["q_b"].shape[0]
        want = {"q_b": (h, cfg.qk_head_dim, cfg.q_in_dim),
                "w_uk": (h, cfg.qk_nope_head_dim, cfg.kv_lora_rank),
                "w_uv": (h, cfg.v_head_dim, cfg.kv_lora_rank),
                "w_o": (h, cfg.v_head_dim, cfg.hidden_size)}
        for name, shape in want.items():
            if tuple(tensors[name].shape) != shape:
                raise ConfigError(f"placed {name} has shape {tuple(tensors[name].shape)}, "
                                  f"expected {shape}")
        if not (0 <= head_start and h > 0 and head_start + h <= cfg.num_attention_heads):
            raise ConfigError(f"head range [{head_start}, {head_start + h}) outside "
                              f"[0, {cfg.num_attention_heads})")
        if not self.keep_placements:
            self._buffers = {k: v for k, v in self._buffers.items() if k == (head_start, h)}
        buf = self._buffers.get((head_start, h))
        if buf is None:
            buf = self._buffers[(head_start, h)] = {k: tensors[k] for k in PLACED_NAMES}
        else:
            for k in PLACED_NAMES:
                if buf[k] is not tensors[k]:
                    buf[k].copy_(tensors[k])
        self.head_start, self.num_heads = head_start, h
        self.q_b, self.w_uk = buf["q_b"], buf["w_uk"]
        self.w_uv, self.w_o = buf["w_uv"], buf["w_o"]

    @property
    def sm_scale(self) -> float:
        return self.cfg.sm_scale

    # --- compute -------------------------------------------------------------------------
    def q_input(self, x: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, q_in): normalised q_a latent, or x itself under q_proj."""
        if self.q_a_proj is None or self.q_a_layernorm is None:
            return x
        return rms_norm(x @ self.q_a_proj.t(), self.q_a_layernorm, LATENT_NORM_EPS)

    # The norm, the rope and the absorbed product write straight into the row they belong to
    # (no concatenation: one kernel fewer each, per layer and step).
    def latent(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        L = self.cfg.kv_lora_rank
        kv = x @ self.kv_a_proj.t()  # (N, L+R)
        row = kv.new_empty(kv.shape, dtype=torch.promote_types(kv.dtype,
                                                               self.kv_a_layernorm.dtype))
        rms_norm(kv[:, :L], self.kv_a_layernorm, LATENT_NORM_EPS, out=row[:, :L])
        self.rope(kv[:, L:], positions, out=row[:, L:])
        return row  # (N, L+R): normalised c_kv ‖ roped k_rope

    def query(self, x: torch.Tensor, positions: torch.Tensor,
              q_in: torch.Tensor | None = None) -> torch.Tensor:
        """``q_in``: ``q_input(x)`` when the caller already has it (a DSA layer's indexer
        reads the same normalised q_a latent)."""
        nope, h, n = self.cfg.qk_nope_head_dim, self.num_heads, x.shape[0]
        L = self.cfg.kv_lora_rank
        q = self._q_heads(self.q_input(x) if q_in is None else q_in)  # (N, h, nope+R)
        out = q.new_empty((n, h, L + self.cfg.qk_rope_head_dim))
        torch.bmm(q[..., :nope].transpose(0, 1), self.w_uk, out=out.transpose(0, 1)[..., :L])
        self.rope(q[..., nope:], positions, out=out[..., L:])
        return out  # (N, h, L+R): absorbed q_nope·W_UK ‖ roped q_rope

    # The non-absorbed form (long prefill chunks, ``splash/layouts/expanded.py``): queries keep
    # their nope dims, the latent rows are expanded into per-head keys and values, and the
    # attention output (value dims) goes straight to o_proj.
    def query_expanded(self, q_in: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(N, q_in) normalised q_a latent -> (N, h, nope + R): q_nope ‖ roped q_rope."""
        nope = self.cfg.qk_nope_head_dim
        q = self._q_heads(q_in)
        self.rope(q[..., nope:].clone(), positions, out=q[..., nope:])
        return q

    def _q_heads(self, q_in: torch.Tensor) -> torch.Tensor:
        """(N, q_in) -> (N, h, nope + R): every head's query before rope and absorption."""
        qk = self.cfg.qk_head_dim
        return (q_in @ self.q_b.reshape(self.num_heads * qk, -1).t()).view(-1, self.num_heads, qk)

    def expand(self, c_kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, L) normalised latent rows -> per-head keys (T, h, nope) and values (T, h, v)."""
        h, t = self.num_heads, c_kv.shape[0]
        c_kv = c_kv.to(self.w_uk.dtype)
        k = c_kv @ self.w_uk.reshape(h * self.cfg.qk_nope_head_dim, -1).t()
        v = c_kv @ self.w_uv.reshape(h * self.cfg.v_head_dim, -1).t()
        return k.view(t, h, -1), v.view(t, h, -1)

    def output_expanded(self, o: torch.Tensor) -> torch.Tensor:
        """(N, h, v) attention output in value dims -> (N, hidden)."""
        h, v = self.num_heads, self.cfg.v_head_dim
        return o.reshape(-1, h * v) @ self.w_o.reshape(h * v, self.cfg.hidden_size)

    def output(self, o_latent: torch.Tensor) -> torch.Tensor:
        h, v = self.num_heads, self.cfg.v_head_dim
        o_latent = o_latent.to(self.w_uv.dtype)
        o = o_latent.new_empty((o_latent.shape[0], h, v))  # the product lands head-interleaved
        torch.bmm(o_latent.transpose(0, 1), self.w_uv.transpose(1, 2), out=o.transpose(0, 1))
        return self.output_expanded(o)  # (N, hidden)
