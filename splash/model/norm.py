"""RMSNorm as DeepSeek/HF compute it: normalise in fp32, cast back, then scale by the weight.

On CUDA one Triton kernel does it (with the residual add before it fused in, for the decoder
layers' norms); elsewhere torch does, with the same numerics (`splash.kernels_triton.rms_norm`).
"""

from __future__ import annotations

import torch

from splash.kernels_triton import add_rms_norm as _add_rms_norm_kernel
from splash.kernels_triton import add_rms_norm_ref, rms_norm_ref
from splash.kernels_triton import rms_norm as _rms_norm_kernel

# q_a_layernorm and kv_a_layernorm use this eps in every family (HF builds them without
# rms_norm_eps), e.g. GLM-5 has rms_norm_eps=1e-5 but latent norms at 1e-6.
LATENT_NORM_EPS = 1e-6


def _kernel(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.version.hip is None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., d), weight (d,) -> (..., d) in x.dtype (or the promoted weight dtype); written
    into ``out`` (a view of x's shape, e.g. columns of wider rows) when given."""
    if _kernel(x):
        return _rms_norm_kernel(x, weight, eps, out=out)
    y = rms_norm_ref(x, weight, eps)
    return y if out is None else out.copy_(y)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, rms_norm(x + residual))."""
    if _kernel(x):
        return _add_rms_norm_kernel(x, residual, weight, eps)
    return add_rms_norm_ref(x, residual, weight, eps)
