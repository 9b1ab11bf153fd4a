"""Dtype names (see `splash.core.dtypes`) to torch dtypes. fp8 has one flavour per backend
(e4m3fn on CUDA, e4m3fnuz on MI300-class ROCm, none on CPU), so it needs the backend's."""

from __future__ import annotations

import torch

from splash.core.dtypes import short_name

__all__ = ["TORCH_DTYPES", "dtype_name", "torch_dtype"]

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def torch_dtype(name: str | torch.dtype, fp8: torch.dtype | None = None) -> torch.dtype:
    """'fp32' | 'bf16' | 'fp16' (or torch's names) -> torch dtype; 'fp8' -> ``fp8``, the
    backend's flavour (an error when the backend has none). A torch dtype passes through."""
    if isinstance(name, torch.dtype):
        return name
    short = short_name(str(name).lower())
    if short != "fp8":
        return TORCH_DTYPES[short]
    if fp8 is None:
        raise ValueError("this backend has no fp8 dtype")
    return fp8


def dtype_name(name: str | torch.dtype) -> str | None:
    """The short name (fp32, fp16, bf16, fp8) of any accepted spelling, or None."""
    try:
        return short_name(str(name).lower())
    except ValueError:
        return None
