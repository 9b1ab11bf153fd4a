"""RMSNorm as DeepSeek/HF compute it: normalise in fp32, cast back, then scale by the weight."""

from __future__ import annotations

import torch

# q_a_layernorm and kv_a_layernorm use this eps in every family (HF builds them without
# rms_norm_eps), e.g. GLM-5 has rms_norm_eps=1e-5 but latent norms at 1e-6.
LATENT_NORM_EPS = 1e-6


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., d), weight (d,) -> (..., d) in x.dtype (or the promoted weight dtype)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)
