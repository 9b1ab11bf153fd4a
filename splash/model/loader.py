"""Read HF safetensors checkpoints lazily, a rank's slice at a time.

Layouts: one `model.safetensors`, shards listed by `model.safetensors.index.json`, or several
`*.safetensors` files without an index. Weight dtypes: fp32 / bf16 / fp16, and DeepSeek
block-scaled FP8 (`float8_e4m3fn` weight + fp32 `weight_scale_inv` per 128×128 block, as
DeepSeek-V3/R1/V3.2 and Kimi-K2 ship): such weights are **dequantised at load** to the target
dtype (bf16 unless asked otherwise) as `w = fp8 × scale_inv[block]`; nothing runs in FP8 here.
MTP layers (`model.layers.{num_hidden_layers}+`) are not exposed (SPLASH does not serve them);
DSA indexer weights (`*.self_attn.indexer.*`) are, for DSA models, with `weights_proj` in fp32.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from splash.backends.dtypes import torch_dtype
from splash.errors import ConfigError, InvalidRequestError
from splash.model.config import ModelConfig

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
# Router weights and the DSA indexer's head weights stay fp32 whatever the model dtype (as HF
# keeps them).
_FP32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias",
                  "indexer.weights_proj.weight")


def resolve_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """The dtype weights load in (None: as stored); fp8 weights are dequantised, never kept."""
    if name is None:
        return None
    try:
        return torch_dtype(name)
    except ValueError:
        raise ConfigError(f"unsupported weight dtype {name!r}; use fp32, bf16 or fp16 "
                          "(or float32, bfloat16, float16)") from None


def dequant_block_fp8(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                      row0: int = 0, col0: int = 0) -> torch.Tensor:
    """w: an (r, c) fp8 slice whose top-left is (row0, col0) of the full matrix; scale_inv: the
    full (ceil(rows/b0), ceil(cols/b1)) block scales -> (r, c) fp32."""
    r, c = w.shape
    if r == 0 or c == 0:
        return w.float()
    b0, b1 = block
    s = scale_inv[row0 // b0:(row0 + r - 1) // b0 + 1, col0 // b1:(col0 + c - 1) // b1 + 1]
    s = s.float().repeat_interleave(b0, 0).repeat_interleave(b1, 1)  # per-element scales
    return w.float() * s[row0 % b0:row0 % b0 + r, col0 % b1:col0 % b1 + c]


class CheckpointWeights(Mapping[str, torch.Tensor]):
    """Read-only mapping of HF tensor names to tensors, read from disk on access.

    `get_slice(name, dim, start, end)` reads only rows (dim 0) or columns (dim 1) of a 2-D
    weight, so a rank loads just its shard. Tensors come back in `dtype` (None: as stored, FP8
    dequantised to bf16; router weights always fp32) on `device`.
    """

    def __init__(self, path: str | Path, cfg: ModelConfig, dtype: torch.dtype | str | None = None,
                 device: torch.device | str = "cpu") -> None:
        self.path, self.cfg = Path(path), cfg
        self.dtype, self.device = resolve_dtype(dtype), torch.device(device)
        self._file_of = _index_files(self.path)
        self._handles: dict[str, Any] = {}
        self._names = sorted(n for n in self._file_of if self._exposed(n))

    def _exposed(self, name: str) -> bool:
        if name.endswith("_scale_inv") or (".self_attn.indexer." in name and not self.cfg.is_dsa):
            return False
        m = _LAYER_RE.match(name)
        return not (m and int(m.group(1)) >= self.cfg.num_hidden_layers)

    def _handle(self, name: str) -> Any:
        fname = self._file_of[name]
        if fname not in self._handles:
            self._handles[fname] = _open(self.path / fname)
        return self._handles[fname]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.get_slice(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._file_of and self._exposed(name)

    def get_slice(self, name: str, dim: int | None, start: int = 0,
                  end: int | None = None) -> torch.Tensor:
        """Whole tensor (dim None) or [start:end) along dim 0 or 1, converted and placed."""
        if name not in self:
            raise KeyError(name)
        sl = self._handle(name).get_slice(name)
        shape = sl.get_shape()
        if dim is None:
            t, row0, col0 = sl[:], 0, 0
        else:
            end = shape[dim] if end is None else end
            t = sl[start:end] if dim == 0 else sl[:, start:end]
            row0, col0 = (start, 0) if dim == 0 else (0, start)
        scale_name = name + "_scale_inv"
        if scale_name in self._file_of:
            block = self.cfg.fp8_block_size or (128, 128)
            scale = self._handle(scale_name).get_tensor(scale_name)
            t = dequant_block_fp8(t, scale, block, row0, col0).to(self.dtype or torch.bfloat16)
        elif name.endswith(_FP32_SUFFIXES):
            t = t.float()
        elif self.dtype is not None and t.is_floating_point():
            t = t.to(self.dtype)
        return t.to(self.device).contiguous()


def checkpoint_shapes(path: str | Path, cfg: ModelConfig) -> tuple[dict[str, tuple[int, ...]],
                                                                    set[str]]:
    """(shape of every tensor the model is built from, every tensor name) of a checkpoint
    directory, read from the safetensors headers alone."""
    weights = CheckpointWeights(path, cfg)
    shapes = {n: tuple(weights._handle(n).get_slice(n).get_shape()) for n in weights}
    return shapes, set(weights._file_of)


_EXPERT_NAME = re.compile(r"(.*\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight")
_FUSED_NAME = re.compile(r"(.*\.mlp\.experts\.)(gate_up|down)_proj")


def with_expert_aliases(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Shapes under both namings of routed experts the loader reads: per expert
    (``experts.{e}.gate_proj.weight``, as checkpoints store them) and fused
    (``experts.gate_up_proj`` (E, 2I, hidden), ``experts.down_proj`` (E, hidden, I), as
    transformers' modules hold them)."""
    out = dict(shapes)
    experts: dict[str, dict[str, tuple[int, ...]]] = {}
    counts: dict[str, int] = {}
    for name, shape in shapes.items():
        if (m := _EXPERT_NAME.fullmatch(name)) is not None:
            experts.setdefault(m.group(1), {})[m.group(3)] = shape
            counts[m.group(1)] = max(counts.get(m.group(1), 0), int(m.group(2)) + 1)
        elif (m := _FUSED_NAME.fullmatch(name)) is not None:
            num, rows, cols = shape
            for e in range(num):
                if m.group(2) == "down":
                    out[f"{m.group(1)}{e}.down_proj.weight"] = (rows, cols)
                else:
                    out[f"{m.group(1)}{e}.gate_proj.weight"] = (rows // 2, cols)
                    out[f"{m.group(1)}{e}.up_proj.weight"] = (rows // 2, cols)
    for prefix, proj in experts.items():
        if "gate" in proj and "down" in proj:
            out[prefix + "gate_up_proj"] = (counts[prefix], 2 * proj["gate"][0], proj["gate"][1])
            out[prefix + "down_proj"] = (counts[prefix], *proj["down"])
    return out


def take(weights: Mapping[str, torch.Tensor], name: str, dim: int | None = None, start: int = 0,
         end: int | None = None) -> torch.Tensor:
    """weights[name], or its [start:end) slice along dim; a missing name is a ConfigError."""
    try:
        if dim is not None and isinstance(weights, CheckpointWeights):
            return weights.get_slice(name, dim, start, end)
        t = weights[name]
    except KeyError:
        raise ConfigError(f"checkpoint has no tensor {name!r}") from None
    if dim is None:
        return t
    end = t.shape[dim] if end is None else end
    return t.narrow(dim, start, end - start)


def _index_files(path: Path) -> dict[str, str]:
    """name -> file (relative to path) for a single-file, indexed, or unindexed sharded dir."""
    if not path.is_dir():
        raise ConfigError(f"checkpoint directory {path} does not exist")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
        except (ValueError, OSError, AttributeError) as e:
            raise ConfigError(f"cannot read {index}: {e}") from None
        missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
        if missing:
            raise ConfigError(f"{index} lists missing shard files: {', '.join(missing[:4])}")
        return dict(weight_map)
    files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors files in {path}")
    out: dict[str, str] = {}
    for f in files:
        with _open(path / f) as h:
            out.update({k: f for k in h.keys()})
    return out


def _open(file: Path) -> Any:
    """safe_open, with a truncated or corrupt file as a ConfigError naming it."""
    try:
        return safe_open(str(file), framework="pt")
    except Exception as e:
        raise ConfigError(f"cannot read {file} (truncated or corrupt?): {e}") from None


def from_pretrained_dir(path: str | Path, dtype: torch.dtype | str | None = None,
                        device: torch.device | str = "cpu") -> tuple[ModelConfig, CheckpointWeights]:
    """(ModelConfig, lazy weights) of an HF checkpoint directory (config.json + safetensors)."""
    cfg = ModelConfig.from_hf(path)
    return cfg, CheckpointWeights(path, cfg, dtype=dtype, device=device)


def weights_to_update(model_path: str, model_cfg: ModelConfig, source: Any
                      ) -> tuple[list[str], Any]:
    """For an in-place weight update of the checkpoint at ``model_path``: the HF names to load
    and what to read them from (a checkpoint directory or a name -> tensor mapping); a mismatch
    with the running checkpoint (architecture, unknown names, shapes) is an error here."""
    shapes, known = checkpoint_shapes(model_path, model_cfg)
    if isinstance(source, (str, os.PathLike)):
        path = str(source)
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(f"{path!r} is not a checkpoint dir (no config.json)")
        other = ModelConfig.from_hf(path)
        differ = [f.name for f in dataclasses.fields(other)
                  if getattr(other, f.name) != getattr(model_cfg, f.name)]
        if differ:
            raise ConfigError(f"{path!r} has a different architecture ({', '.join(differ)} "
                              "differ): only weights of the same architecture load in place")
        new, _ = checkpoint_shapes(path, model_cfg)
        for name, shape in shapes.items():
            if new.get(name) != shape:
                raise ConfigError(f"{path!r}: tensor {name!r} is "
                                  f"{new.get(name, 'missing')}, the model has {shape}")
        return sorted(shapes), path
    if not isinstance(source, Mapping):
        raise InvalidRequestError("update_weights takes a checkpoint directory or a mapping "
                                  "of tensor names to tensors")
    shapes = with_expert_aliases(shapes)
    known |= set(shapes)
    names = []
    for name, t in source.items():
        if name not in known:
            raise InvalidRequestError(f"the model has no tensor {name!r}")
        if name not in shapes:
            continue  # in the checkpoint, not served (MTP layers, DSA indexer)
        if tuple(getattr(t, "shape", ())) != shapes[name]:
            raise InvalidRequestError(f"tensor {name!r} has shape "
                                      f"{tuple(getattr(t, 'shape', ()))}, the model has "
                                      f"{shapes[name]}")
        names.append(name)
    if not names:
        raise InvalidRequestError("none of the given tensors is one the model is built from")
    return names, {n: source[n] for n in names}

