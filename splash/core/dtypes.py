"""Dtype names and their sizes, without torch: the byte accounting of the memory and cost
models reads them (the torch dtypes themselves are resolved on the worker side)."""

from __future__ import annotations

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2,
               "fp8": 1, "float8_e4m3fn": 1, "float8_e4m3fnuz": 1}


def dtype_bytes(name: str) -> int:
    try:
        return DTYPE_BYTES[name.replace("torch.", "")]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {sorted(DTYPE_BYTES)}") from None
