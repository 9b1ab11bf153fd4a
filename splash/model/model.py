"""MLAModel: embeddings, decoder layers, final norm and lm_head, with attention injected.

Each layer is `h += attn_fn(i, attn, norm(h))` then `h += all_reduce(mlp(norm(h)))`. The
caller's `attn_fn` runs attention in its layout (paged TP / DP / CP / DOP) on the layer's
`MLAAttention` and returns the complete attention output for every row; `all_reduce` sums
the tensor-parallel MLP partials over ranks. `DenseReferenceAttention` is a plain-torch,
non-paged `attn_fn` for tests and references.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from splash.errors import ConfigError
from splash.kernels_triton import plan_scope
from splash.model.attention import MLAAttention
from splash.model.config import ModelConfig
from splash.model.loader import from_pretrained_dir, take
from splash.model.mlp import DenseMLP, MoE
from splash.model.norm import add_rms_norm, rms_norm
from splash.model.rope import RotaryEmbedding

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
AttnFn = Callable[[int, MLAAttention, torch.Tensor], torch.Tensor]
AllReduce = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class DecoderLayer:
    input_layernorm: torch.Tensor  # (hidden,)
    self_attn: MLAAttention
    post_attention_layernorm: torch.Tensor  # (hidden,)
    mlp: DenseMLP | MoE


class MLAModel:
    """One rank's share of an MLA model: replicated embeddings, norms and lm_head; attention
    heads [head_start, head_start + num_heads) of every layer; slice `rank` of `world` of the
    MLP/MoE intermediate dims.

    `forward(input_ids (N,), positions (N,), attn_fn, all_reduce) -> (N, hidden)` final-normed
    hidden states; `attn_fn(layer_idx, attn, h_normed (N, hidden)) -> (N, hidden)` must return
    the full attention output (it knows the step's positions and histories);
    `compute_logits(rows (n, hidden)) -> (n, vocab)` fp32.
    """

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, torch.Tensor], rank: int = 0,
                 world: int = 1, head_start: int = 0, num_heads: int | None = None,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        if not 0 <= rank < world:
            raise ConfigError(f"rank {rank} outside world of {world}")
        self.cfg, self.rank, self.world = cfg, rank, world

        def get(name: str) -> torch.Tensor:
            return take(weights, name).to(device=device, dtype=dtype).contiguous()

        self.embed_tokens = get("model.embed_tokens.weight")  # (V, hidden)
        self.tied = "lm_head.weight" not in weights and cfg.tie_word_embeddings
        self.lm_head = self.embed_tokens if self.tied else get("lm_head.weight")  # (V, hidden)
        self.norm = get("model.norm.weight")
        self.rope = RotaryEmbedding(cfg, device)
        self.layers: list[DecoderLayer] = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            attn = MLAAttention.from_weights(cfg, weights, i, head_start, num_heads, self.rope,
                                             dtype=dtype, device=device)
            mlp: DenseMLP | MoE
            if cfg.is_moe_layer(i):
                mlp = MoE.from_weights(cfg, weights, p + "mlp.", rank, world, dtype, device)
            else:
                mlp = DenseMLP.from_weights(weights, p + "mlp.", cfg.intermediate_size, rank,
                                            world, dtype, device)
            self.layers.append(DecoderLayer(get(p + "input_layernorm.weight"), attn,
                                            get(p + "post_attention_layernorm.weight"), mlp))

    @classmethod
    def from_pretrained(cls, path: str | Path, rank: int = 0, world: int = 1,
                        head_start: int = 0, num_heads: int | None = None,
                        dtype: torch.dtype | str | None = None,
                        device: torch.device | str | None = None,
                        also_hold: Iterable[range] = ()) -> MLAModel:
        """Load a checkpoint directory, reading only this rank's slices from disk.
        ``also_hold``: further head ranges every attention layer holds beside its own
        (`MLAAttention.hold`)."""
        cfg, weights = from_pretrained_dir(path, dtype=dtype, device="cpu")
        model = cls(cfg, weights, rank, world, head_start, num_heads, weights.dtype, device)
        for heads in also_hold:
            for i, attn in enumerate(model.attn_layers):
                attn.hold(weights, f"model.layers.{i}.self_attn.", heads)
        return model

    @property
    def attn_layers(self) -> list[MLAAttention]:
        return [layer.self_attn for layer in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_fn: AttnFn,
                all_reduce: AllReduce | None = None) -> torch.Tensor:
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(f"input_ids and positions must both be (N,), got "
                             f"{tuple(input_ids.shape)} and {tuple(positions.shape)}")
        eps = self.cfg.rms_norm_eps
        h = self.embed_tokens[input_ids]  # (N, hidden)
        x = rms_norm(h, self.layers[0].input_layernorm, eps) if self.layers else h
        # each residual add is fused with the norm after it (the next layer's input norm, the
        # final norm after the last layer)
        norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        with plan_scope():  # the layers share their lengths: decode splits planned once
            for i, layer in enumerate(self.layers):
                h, x = add_rms_norm(h, attn_fn(i, layer.self_attn, x),
                                    layer.post_attention_layernorm, eps)
                partial = layer.mlp(x)
                h, x = add_rms_norm(h, partial if all_reduce is None else all_reduce(partial),
                                    norms[i], eps)
        return x if self.layers else rms_norm(h, self.norm, eps)

    __call__ = forward

    def load_weights(self, weights: Mapping[str, torch.Tensor], names: Iterable[str]) -> list[str]:
        """Copy new values of the HF tensors ``names`` (read from ``weights``) into this rank's
        tensors in place, sliced and placed as they are held now: the addresses never change,
        so captured CUDA graphs stay valid. Returns the names this model does not hold."""
        unused = []
        for name in names:
            if not self._load_one(weights, name):
                unused.append(name)
        return unused

    def _load_one(self, weights: Mapping[str, torch.Tensor], name: str) -> bool:
        top = {"model.embed_tokens.weight": self.embed_tokens, "model.norm.weight": self.norm}
        if not self.tied:
            top["lm_head.weight"] = self.lm_head
        if name in top:
            top[name].copy_(take(weights, name))
            return True
        m = _LAYER.fullmatch(name)
        if m is None or int(m.group(1)) >= len(self.layers):
            return False
        layer, rest = self.layers[int(m.group(1))], m.group(2)
        prefix = name[: len(name) - len(rest)]
        if rest in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            getattr(layer, rest.removesuffix(".weight")).copy_(take(weights, name))
            return True
        if rest.startswith("self_attn."):
            return layer.self_attn.load_weight(weights, rest.removeprefix("self_attn."),
                                               prefix + "self_attn.")
        if rest.startswith("mlp."):
            return layer.mlp.load_weight(weights, rest.removeprefix("mlp."), prefix + "mlp.")
        return False

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (n, hidden) final-normed rows -> (n, vocab) fp32 logits."""
        return (hidden.to(self.lm_head.dtype) @ self.lm_head.t()).float()


class DenseReferenceAttention:
    """Reference `attn_fn`: exact causal softmax over each sequence's latent history, kept in
    plain per-(layer, sequence) tensors. Call `set_step(seq_ids, positions)` before each
    forward; a sequence's rows must continue its history (positions len(history), +1, ...).
    Returns this rank's partial for the held heads (all heads: the full output).
    DSA layers attend only the positions their indexer picks with torch.topk, as transformers
    does (a layer without an indexer reuses the previous indexer layer's picks).
    """

    def __init__(self) -> None:
        self.history: dict[tuple[int, int], torch.Tensor] = {}  # (layer, seq) -> (T, L+R)
        self.index_keys: dict[tuple[int, int], torch.Tensor] = {}  # (layer, seq) -> (T, I)
        self.picked: dict[int, torch.Tensor] = {}  # seq -> (n, T) bool, the last indexer's
        self.seq_ids: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None

    def set_step(self, seq_ids: Sequence[int] | torch.Tensor, positions: torch.Tensor) -> None:
        self.seq_ids = torch.as_tensor(seq_ids, device=positions.device)
        self.positions = positions

    def forget(self, seq_id: int) -> None:
        for key in [k for k in self.history if k[1] == seq_id]:
            del self.history[key]
        for key in [k for k in self.index_keys if k[1] == seq_id]:
            del self.index_keys[key]

    def _pick(self, layer_idx: int, seq: int, attn: MLAAttention, x: torch.Tensor,
              pos: torch.Tensor) -> torch.Tensor:
        """(n, T) bool: the positions the DSA indexer picks for rows x (n, hidden) of ``seq``."""
        ix = attn.indexer
        if ix is None:
            return self.picked[seq]
        keys = torch.cat((self.index_keys.get((layer_idx, seq), x.new_zeros(0, ix.head_dim)),
                          ix.key(x, pos)))  # (T, I)
        self.index_keys[(layer_idx, seq)] = keys
        q = ix.query(attn.q_input(x), pos).float()  # (n, HI, I)
        scores = torch.relu(torch.einsum("nhd,td->nht", q, keys.float()) * ix.softmax_scale)
        total = torch.einsum("nh,nht->nt", ix.head_weights(x), scores)  # (n, T)
        future = torch.arange(keys.shape[0], device=x.device)[None, :] > pos[:, None]
        top = total.masked_fill(future, float("-inf")).topk(min(ix.topk, keys.shape[0])).indices
        picked = torch.zeros_like(future).scatter(1, top, True) & ~future
        self.picked[seq] = picked
        return picked

    def __call__(self, layer_idx: int, attn: MLAAttention, x: torch.Tensor) -> torch.Tensor:
        assert self.seq_ids is not None and self.positions is not None, "call set_step first"
        L = attn.cfg.kv_lora_rank
        latent = attn.latent(x, self.positions)  # (N, D)
        query = attn.query(x, self.positions)  # (N, h, D)
        out = torch.empty(x.shape[0], attn.cfg.hidden_size, dtype=x.dtype, device=x.device)
        for seq in dict.fromkeys(self.seq_ids.tolist()):
            rows = (self.seq_ids == seq).nonzero(as_tuple=True)[0]
            pos = self.positions[rows]
            past = self.history.get((layer_idx, seq), latent[:0])
            if pos.tolist() != list(range(past.shape[0], past.shape[0] + rows.numel())):
                raise ValueError(f"sequence {seq}: positions {pos.tolist()} do not continue a "
                                 f"history of {past.shape[0]} tokens")
            kv = torch.cat((past, latent[rows]))  # (T, D)
            self.history[(layer_idx, seq)] = kv
            scores = torch.einsum("nhd,td->nht", query[rows].float(), kv.float()) * attn.sm_scale
            hidden = torch.arange(kv.shape[0], device=x.device)[None, :] > pos[:, None]  # (n, T)
            if attn.is_sparse:
                hidden = ~self._pick(layer_idx, seq, attn, x[rows], pos)
            scores = scores.masked_fill(hidden[:, None, :], float("-inf"))
            o = torch.einsum("nht,tl->nhl", scores.softmax(-1), kv[:, :L].float())  # (n, h, L)
            out[rows] = attn.output(o.to(x.dtype)).to(x.dtype)
        return out
