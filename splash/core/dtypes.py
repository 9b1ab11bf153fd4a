"""Dtype names and their sizes, without torch. A dtype is named by its short name (fp32, bf16,
fp16, fp8) or by torch's / Hugging Face's name (float32, bfloat16, float16 or half,
float8_e4m3fn, float8_e4m3fnuz); `short_name` maps either to the short one. The byte accounting of the memory
and cost models reads the sizes; `splash.backends.dtypes` maps the names to torch dtypes."""

from __future__ import annotations

_SHORT = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16",
          "fp16": "fp16", "float16": "fp16", "half": "fp16", "fp8": "fp8",
          "float8_e4m3fn": "fp8", "float8_e4m3fnuz": "fp8"}
_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
DTYPE_BYTES = {name: _BYTES[short] for name, short in _SHORT.items()}


def short_name(name: str) -> str:
    """fp32 | bf16 | fp16 | fp8 for any known name ("torch." prefix allowed)."""
    try:
        return _SHORT[name.replace("torch.", "")]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {sorted(_SHORT)}") from None


def dtype_bytes(name: str) -> int:
    return _BYTES[short_name(name)]
