"""Rotary embedding of the `qk_rope_head_dim` slice, plain or YaRN, interleaved or half split.

Frequencies follow HF `_compute_yarn_parameters` exactly (fp32, truncated correction range);
cos/sin carry the YaRN attention factor, so both q_rope and k_rope are scaled by it.
Interleaved RoPE rotates adjacent pairs (x0, x1), (x2, x3), ... and keeps that layout;
HF's deepseek_v3 de-interleaves the output instead, which permutes q and k alike and leaves
every q·k unchanged.
"""

from __future__ import annotations

import math

import torch

from splash.kernels_triton import rope, rope_ref
from splash.model.config import ModelConfig, RopeScaling


def inv_frequencies(dim: int, theta: float, scaling: RopeScaling | None) -> tuple[torch.Tensor, float]:
    """Return (inv_freq (dim/2,) fp32, cos/sin scale) for plain RoPE or YaRN."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    inv_extra = 1.0 / pos_freqs
    if scaling is None:
        return inv_extra, 1.0
    inv_inter = 1.0 / (scaling.factor * pos_freqs)
    orig = scaling.original_max_position_embeddings

    def correction_dim(num_rot: float) -> float:
        return dim * math.log(orig / (num_rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extra_weight = 1 - ramp  # 1: keep original frequency (high-frequency dims)
    return inv_inter * (1 - extra_weight) + inv_extra * extra_weight, scaling.cos_sin_scale


class RotaryEmbedding:
    """Applies RoPE to (N, ..., R) tensors given (N,) integer positions: one Triton kernel on
    CUDA, the same arithmetic in torch elsewhere (`splash.kernels_triton.rope`)."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str | None = None,
                 interleave: bool | None = None) -> None:
        self.dim = cfg.qk_rope_head_dim
        self.interleave = cfg.rope_interleave if interleave is None else interleave
        inv_freq, self.scale = inv_frequencies(self.dim, cfg.rope_theta, cfg.rope_scaling)
        self.inv_freq = inv_freq.to(device)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """x (N, ..., R) -> rotated, same shape and dtype; or written into ``out`` (a view of
        x's shape, e.g. the rope columns of wider rows)."""
        inv_freq = self.inv_freq.to(positions.device)
        if _kernel(x):
            return rope(x, positions, inv_freq, self.scale, self.interleave, out=out)
        y = rope_ref(x, positions, inv_freq, self.scale, self.interleave)
        return y if out is None else out.copy_(y)


def _kernel(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.version.hip is None
