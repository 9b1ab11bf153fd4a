"""ModelConfig: one frozen, validated description of an MLA model, read from an HF config.json.

Imports no torch, so the controller (which holds no device tensors) and `splash plan` can use it.
Per-family rules follow the HF transformers classes, which are the numerical oracle:

- deepseek_v2: softmax router, `topk_method` greedy | group_limited_greedy (group score = max).
- deepseek_v3 (also `kimi_k2`), deepseek_v32, glm_moe_dsa: sigmoid router with
  `e_score_correction_bias` and group-limited top-k ("noaux_tc", group score = sum of top-2),
  whatever `scoring_func` / `topk_method` the json states (HF ignores them too).
- MoE layers: `mlp_layer_types` when given (v32/glm), else `i >= first_k_dense_replace`
  (and `i % moe_layer_freq == 0`, always 1 in released models).
- RoPE on the `qk_rope_head_dim` slice is interleaved (adjacent pairs) except deepseek_v3 with
  `rope_interleave: false` (half split).
- DSA (deepseek_v32, glm_moe_dsa): a lightning indexer per layer picks `index_topk` positions
  per query; its RoPE (on the first `qk_rope_head_dim` dims of its keys and queries) is half
  split in deepseek_v32 and interleaved in glm_moe_dsa. glm_moe_dsa layers are "full" (own
  indexer) or "shared" (reuse the previous full layer's selection): `indexer_types`, else
  `index_topk_pattern` ("FSS..."), else `index_topk_freq` / `index_skip_topk_offset`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splash.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2", "deepseek_v32", "glm_moe_dsa")
DSA_MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")
# Values HF forces per family (json values for these keys are ignored, as HF ignores them).
_FIXED: dict[str, dict[str, Any]] = {
    "deepseek_v2": {"scoring_func": "softmax", "rope_interleave": True},
    "deepseek_v3": {"scoring_func": "sigmoid", "topk_method": "noaux_tc"},
    "deepseek_v32": {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "rope_interleave": True},
    "glm_moe_dsa": {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "rope_interleave": True},
}
# HF config-class defaults for keys a config.json may omit.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v2": {"first_k_dense_replace": 0, "n_group": 1, "topk_group": 1,
                    "norm_topk_prob": False, "routed_scaling_factor": 1.0, "rms_norm_eps": 1e-6,
                    "topk_method": "greedy"},
    "deepseek_v3": {"first_k_dense_replace": 3, "n_group": 8, "topk_group": 4,
                    "norm_topk_prob": True, "routed_scaling_factor": 2.5, "rms_norm_eps": 1e-6,
                    "rope_interleave": True},
    "deepseek_v32": {"first_k_dense_replace": 3, "n_group": 8, "topk_group": 4,
                     "norm_topk_prob": True, "routed_scaling_factor": 2.5, "rms_norm_eps": 1e-6,
                     "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64},
    "glm_moe_dsa": {"first_k_dense_replace": 3, "n_group": 1, "topk_group": 1,
                    "norm_topk_prob": True, "routed_scaling_factor": 2.5, "rms_norm_eps": 1e-5,
                    "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32},
}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
             "v_head_dim")


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN magnitude correction 0.1·mscale·ln(scale) + 1 (1 when not extending)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters, named as HF `rope_parameters` names them (the only scaling supported)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # scales cos/sin; None: derived from mscale(s)
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.factor < 1 or self.original_max_position_embeddings <= 0:
            raise ConfigError(f"invalid YaRN rope scaling {self}")

    @property
    def cos_sin_scale(self) -> float:
        """Factor on cos/sin (so on both q_rope and k_rope), as HF `_compute_yarn_parameters`."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(
                self.factor, self.mscale_all_dim)
        return yarn_get_mscale(self.factor)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of one MLA model. Fields carry HF names; build with `from_hf`.

    Derived: `kv_dim` (L + R, one latent KV row), `qk_head_dim`, `q_in_dim`, `sm_scale`
    (YaRN mscale included), `is_moe_layer(i)`, `eos_token_ids`, `is_dsa`, `has_indexer(i)`,
    `num_indexer_layers`, `index_rope_interleave`.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None  # None: plain RoPE
    rope_interleave: bool = True
    mlp_layer_types: tuple[str, ...] = ()  # "dense" | "sparse" per layer; () = all dense
    first_k_dense_replace: int = 0
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    scoring_func: str = "softmax"  # "softmax" | "sigmoid"
    topk_method: str = "greedy"  # "greedy" | "group_limited_greedy" | "noaux_tc"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    index_topk: int | None = None  # DSA models only
    index_head_dim: int | None = None
    index_n_heads: int | None = None
    indexer_types: tuple[str, ...] = ()  # DSA: "full" | "shared" per layer
    num_nextn_predict_layers: int = 0  # MTP layers in the checkpoint (skipped)
    fp8_block_size: tuple[int, int] | None = None  # block-scaled FP8 checkpoint
    dtype: str = "bfloat16"  # checkpoint dtype as config.json states it

    def __post_init__(self) -> None:
        def bad(msg: str) -> ConfigError:
            return ConfigError(f"{self.model_type} config: {msg}")

        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise bad(f"unsupported model_type; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        for name in _REQUIRED:
            if getattr(self, name) <= 0:
                raise bad(f"{name} must be positive, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise bad("q_lora_rank must be positive or null")
        if self.qk_rope_head_dim % 2:
            raise bad("qk_rope_head_dim must be even")
        if self.hidden_act != "silu":
            raise bad(f"hidden_act {self.hidden_act!r} unsupported (only silu)")
        if self.mlp_layer_types and len(self.mlp_layer_types) != self.num_hidden_layers:
            raise bad(f"mlp_layer_types has {len(self.mlp_layer_types)} entries, "
                      f"num_hidden_layers is {self.num_hidden_layers}")
        if set(self.mlp_layer_types) - {"dense", "sparse"}:
            raise bad(f"mlp_layer_types entries must be 'dense' or 'sparse': {self.mlp_layer_types}")
        if self.scoring_func not in ("softmax", "sigmoid"):
            raise bad(f"scoring_func {self.scoring_func!r} unsupported")
        if self.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise bad(f"topk_method {self.topk_method!r} unsupported")
        if "sparse" in self.mlp_layer_types:
            e, k = self.n_routed_experts, self.num_experts_per_tok
            if e <= 0 or not 0 < k <= e or self.moe_intermediate_size <= 0:
                raise bad(f"MoE needs n_routed_experts >= num_experts_per_tok > 0 and "
                          f"moe_intermediate_size > 0 (got {e}, {k}, {self.moe_intermediate_size})")
            if self.n_group <= 0 or e % self.n_group or not 0 < self.topk_group <= self.n_group:
                raise bad(f"n_group {self.n_group} must divide {e} experts and "
                          f"0 < topk_group {self.topk_group} <= n_group")
            if self.topk_method == "noaux_tc" and e // self.n_group < 2:
                raise bad("noaux_tc routing scores each group by its top-2 experts: "
                          "needs >= 2 experts per group")
        if self.model_type in DSA_MODEL_TYPES:
            self._check_dsa(bad)

    def _check_dsa(self, bad: Any) -> None:
        if not (self.index_topk or 0) > 0:
            raise bad("DSA model needs index_topk > 0")
        if not (self.index_n_heads or 0) > 0:
            raise bad("DSA model needs index_n_heads > 0")
        if (self.index_head_dim or 0) < self.qk_rope_head_dim:
            raise bad(f"index_head_dim {self.index_head_dim} must hold the rope slice "
                      f"({self.qk_rope_head_dim} dims)")
        if self.q_lora_rank is None:
            raise bad("the DSA indexer reads the q LoRA latent: q_lora_rank must be set")
        if len(self.indexer_types) != self.num_hidden_layers:
            raise bad(f"indexer_types has {len(self.indexer_types)} entries, "
                      f"num_hidden_layers is {self.num_hidden_layers}")
        if set(self.indexer_types) - {"full", "shared"} or self.indexer_types[0] != "full":
            raise bad(f"indexer_types must be 'full' or 'shared', starting with 'full': "
                      f"{self.indexer_types}")

    # --- derived -------------------------------------------------------------------------
    @property
    def kv_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def q_in_dim(self) -> int:
        """Input width of q_b (q_lora_rank), or hidden_size when q_proj is used directly."""
        return self.q_lora_rank if self.q_lora_rank is not None else self.hidden_size

    @property
    def sm_scale(self) -> float:
        """Softmax scale: qk_head_dim^-0.5 times mscale(factor, mscale_all_dim)^2 under YaRN."""
        scale = self.qk_head_dim ** -0.5
        rs = self.rope_scaling
        if rs is not None and rs.mscale_all_dim:
            scale *= yarn_get_mscale(rs.factor, rs.mscale_all_dim) ** 2
        return scale

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.eos_token_id)

    @property
    def is_dsa(self) -> bool:
        return self.model_type in DSA_MODEL_TYPES

    def has_indexer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` runs its own DSA indexer (and stores indexer keys)."""
        return self.is_dsa and self.indexer_types[layer_idx] == "full"

    @property
    def num_indexer_layers(self) -> int:
        return sum(t == "full" for t in self.indexer_types)

    @property
    def index_rope_interleave(self) -> bool:
        """The indexer's RoPE: interleaved pairs (glm_moe_dsa) or half split (deepseek_v32)."""
        return self.model_type == "glm_moe_dsa"

    def is_moe_layer(self, layer_idx: int) -> bool:
        if not 0 <= layer_idx < self.num_hidden_layers:
            raise IndexError(f"layer {layer_idx} out of range [0, {self.num_hidden_layers})")
        return bool(self.mlp_layer_types) and self.mlp_layer_types[layer_idx] == "sparse"

    # --- construction --------------------------------------------------------------------
    @classmethod
    def from_hf(cls, source: str | Path | Mapping[str, Any]) -> ModelConfig:
        """Build from an HF config dict, a config.json path, or a checkpoint directory."""
        if isinstance(source, Mapping):
            d = dict(source)
        else:
            path = Path(source)
            path = path / "config.json" if path.is_dir() else path
            if not path.is_file():
                raise ConfigError(f"no HF config.json at {path}")
            try:
                d = json.loads(path.read_text())
            except (ValueError, OSError) as e:
                raise ConfigError(f"cannot read {path} as JSON: {e}") from None
            if not isinstance(d, dict):
                raise ConfigError(f"{path} must hold a JSON object")
        mt = d.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"unsupported model_type {mt!r}; supported: "
                              f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        family = "deepseek_v3" if mt == "kimi_k2" else mt
        missing = [k for k in _REQUIRED if k not in d]
        if missing:
            raise ConfigError(f"{mt} config lacks {', '.join(missing)}")
        if d.get("attention_bias") or d.get("mlp_bias"):
            raise ConfigError(f"{mt} config: attention_bias / mlp_bias are not supported")
        v = {**_DEFAULTS[family], **{k: x for k, x in d.items() if x is not None},
             **_FIXED[family]}
        fields = {k: v[k] for k in _REQUIRED}
        fields.update({k: v[k] for k in cls.__dataclass_fields__
                       if k in v and k not in fields and k in _PLAIN_KEYS})
        fields["model_type"] = mt
        # null = q_proj (V2-Lite); absent = the HF class default
        fields["q_lora_rank"] = d["q_lora_rank"] if "q_lora_rank" in d else 1536
        fields["eos_token_id"] = _int_tuple(d.get("eos_token_id"))
        fields["rope_theta"], fields["rope_scaling"] = _parse_rope(d)
        fields["mlp_layer_types"] = _mlp_layer_types(family, d, v)
        fields["num_nextn_predict_layers"] = int(
            d.get("num_nextn_predict_layers") or d.get("num_mtp_layers") or 0)
        fields["fp8_block_size"] = _fp8_block(d)
        fields["dtype"] = str(d.get("dtype") or d.get("torch_dtype") or "bfloat16")
        if family not in DSA_MODEL_TYPES:
            for k in ("index_topk", "index_head_dim", "index_n_heads"):
                fields.pop(k, None)
        else:
            fields["indexer_types"] = _indexer_types(mt, d)
        return cls(**fields)


_PLAIN_KEYS = frozenset((
    "rms_norm_eps", "hidden_act", "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
    "rope_interleave", "first_k_dense_replace", "moe_intermediate_size", "n_routed_experts",
    "n_shared_experts", "num_experts_per_tok", "scoring_func", "topk_method", "n_group",
    "topk_group", "norm_topk_prob", "routed_scaling_factor", "index_topk", "index_head_dim",
    "index_n_heads"))


def _int_tuple(x: Any) -> tuple[int, ...]:
    if x is None:
        return ()
    return tuple(int(i) for i in x) if isinstance(x, (list, tuple)) else (int(x),)


def _parse_rope(d: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """Read transformers-5 `rope_parameters` or the older `rope_scaling` + `rope_theta`."""
    rp = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = float(rp.get("rope_theta") or d.get("rope_theta") or 10000.0)
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type not in ("yarn", "deepseek_yarn"):
        raise ConfigError(f"rope type {rope_type!r} unsupported (only default and yarn)")
    max_pos = int(d.get("max_position_embeddings", 4096))
    orig = int(rp.get("original_max_position_embeddings")
               or d.get("original_max_position_embeddings") or max_pos)
    factor = rp.get("factor")
    opt = {k: float(rp[k]) for k in ("mscale", "mscale_all_dim", "attention_factor")
           if rp.get(k) is not None}
    return theta, RopeScaling(
        factor=float(factor) if factor is not None else max_pos / orig,
        original_max_position_embeddings=orig,
        beta_fast=float(rp.get("beta_fast") or 32), beta_slow=float(rp.get("beta_slow") or 1),
        truncate=bool(rp.get("truncate", True)), **opt)


def _mlp_layer_types(family: str, d: Mapping[str, Any], v: Mapping[str, Any]) -> tuple[str, ...]:
    n = int(d["num_hidden_layers"])
    if not v.get("n_routed_experts"):
        return ("dense",) * n
    if family in DSA_MODEL_TYPES and d.get("mlp_layer_types"):
        return tuple(str(t) for t in d["mlp_layer_types"])
    k, freq = int(v["first_k_dense_replace"]), int(d.get("moe_layer_freq") or 1)
    return tuple("sparse" if i >= k and i % freq == 0 else "dense" for i in range(n))


def _indexer_types(model_type: str, d: Mapping[str, Any]) -> tuple[str, ...]:
    """Per-layer "full" / "shared" as transformers' GlmMoeDsaConfig derives it (v32: all full)."""
    n = int(d["num_hidden_layers"])
    if model_type != "glm_moe_dsa":
        return ("full",) * n
    if d.get("indexer_types"):
        return tuple(str(t) for t in d["indexer_types"])
    pattern = d.get("index_topk_pattern")
    if pattern is not None:
        names = {"F": "full", "S": "shared"}
        return tuple(names.get(c, c) for c in pattern) if isinstance(pattern, str) \
            else tuple(str(t) for t in pattern)
    freq = max(int(d.get("index_topk_freq") or 1), 1)
    offset = int(d.get("index_skip_topk_offset", 2))
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n))


def _fp8_block(d: Mapping[str, Any]) -> tuple[int, int] | None:
    q = d.get("quantization_config")
    if not q:
        return None
    if q.get("quant_method") != "fp8":
        raise ConfigError(f"quantization {q.get('quant_method')!r} unsupported "
                          "(only DeepSeek block-scaled fp8)")
    b = q.get("weight_block_size") or (128, 128)
    return int(b[0]), int(b[1])
