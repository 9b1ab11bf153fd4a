"""Checks shared by the kernel launchers, so a bad argument raises ``ValueError`` with a message
that names the argument instead of crashing inside Triton.

Two kinds of check:

- *metadata* checks (shape, dtype, stride, device) cost nothing and always run;
- *value* checks (a block table too short for a length, a page id outside the pool, an index out
  of range) read tensor values, which on a GPU is a host sync. They run by default and are
  skipped while a CUDA graph is being captured; a hot loop that has validated its metadata
  elsewhere may turn them off with ``set_value_checks(False)``.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
KV_DTYPES: tuple[torch.dtype, ...] = FLOAT_DTYPES + FP8_DTYPES
INDEX_DTYPES: tuple[torch.dtype, ...] = (torch.int32, torch.int64)

# integer dtype of the same width, for kernels that move bits without looking at them
_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

_value_checks = True


def set_value_checks(enabled: bool) -> None:
    """Turn the value checks (which sync the device) on or off for every launcher."""
    global _value_checks
    _value_checks = bool(enabled)


def value_checks_enabled() -> bool:
    if not _value_checks:
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def ptx_fp8_widen(cfg: dict, fp16_products: bool, dtype: torch.dtype,
                  device: torch.device) -> bool:
    """Whether a launch widens its fp8 tiles to fp16 through PTX's native e4m3 conversion
    (``_widen_kv``): fp16 products, ``cfg["fp8_ptx"]`` (default on), an e4m3fn cache, and an
    NVIDIA GPU of compute capability 8.9 or newer, compiled (not interpreted)."""
    return (fp16_products and bool(cfg.get("fp8_ptx", True)) and dtype == torch.float8_e4m3fn
            and device.type == "cuda" and torch.version.hip is None and not interpreting()
            and _capability(device.index) >= (8, 9))


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index or 0)


def compiled_hopper(t: torch.Tensor) -> bool:
    """Whether ``t`` lives on an NVIDIA sm_90 GPU and kernels compile (not interpreted): where
    the Gluon kernels, written for Hopper's warpgroup MMAs, run."""
    return t.is_cuda and torch.version.hip is None and not interpreting() \
        and _capability(t.device.index)[0] == 9


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as the integer dtype of the same width (bit-exact copies, any dtype)."""
    return t.view(_BITS_DTYPE[t.element_size()])


def low_partial_splits(cfg: dict, out_dtype: torch.dtype) -> int:
    """The most splits a request may have for its split-KV partials to be written in a 16-bit
    output's own dtype (half the partials' traffic; one more rounding, of a normalised
    partial, at the output's own precision): ``config["low_partials"]`` True (every request),
    an int n (requests of at most n splits; more keep fp32, where many partials' roundings
    would add up), or off (0). fp32 outputs always keep fp32 partials."""
    low = cfg.get("low_partials")
    if not low or out_dtype not in (torch.bfloat16, torch.float16):
        return 0
    if low is True:
        return 65535
    if not isinstance(low, int) or low < 2:
        raise ValueError(f"config low_partials={low!r} must be a bool or an int >= 2 (splits)")
    return low


def partial_dtype(cfg: dict, out_dtype: torch.dtype, splits: int) -> torch.dtype:
    """The dtype of the partials of ``splits`` splits a request (``low_partial_splits``)."""
    return out_dtype if splits <= low_partial_splits(cfg, out_dtype) else torch.float32


def next_pow2(x: int, minimum: int = 16) -> int:
    return max(minimum, 1 << max(int(x) - 1, 0).bit_length())


def gathered_ids(count: int, enabled: Any, most: int) -> int:
    """A kernel's register room for ``count`` gathered ids (page or slot ids loaded once and
    looked up per tile): the power of two holding them, or 0 (ids loaded per tile) when
    ``enabled`` is off or they would take more than ``most``."""
    room = next_pow2(count, 1)
    return room if enabled and room <= most else 0


@functools.cache
def _num_sms(device_type: str, index: int | None) -> int:
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(index or 0).multi_processor_count
    return 4


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors (compute units) of ``device``; 4 for the CPU interpreter."""
    return _num_sms(device.type, device.index)


def row_bound(max_rows: int | None, n: int) -> int:
    """The most rows of one request a launch plans its grid for: ``max_rows`` (the caller's
    word, e.g. 1 at decode) or, without it, all ``n`` rows (a bound needing no host sync)."""
    if max_rows is None:
        return n
    if not isinstance(max_rows, int) or isinstance(max_rows, bool) or max_rows < 1:
        raise ValueError(f"max_rows={max_rows!r} must be an int >= 1 (or None)")
    return min(max_rows, n)


def check_max_rows(q_start_loc: torch.Tensor, max_rows: int | None) -> None:
    """With value checks on, that no request has more rows than ``max_rows`` says."""
    if max_rows is None or not value_checks_enabled() or q_start_loc.shape[0] < 2:
        return
    most = int((q_start_loc[1:].long() - q_start_loc[:-1].long()).max())
    if most > max_rows:
        raise ValueError(f"a request has {most} rows; max_rows={max_rows}")


def check_tensor(
    name: str,
    t: object,
    ndim: int,
    dtypes: tuple[torch.dtype, ...] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """``t`` is a tensor of ``ndim`` dims, one of ``dtypes``, on ``device``."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name} has dtype {t.dtype}; expected one of {allowed}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other tensors are on {device}")
    return t


def check_dim(name: str, t: torch.Tensor, dim: int, size: int, what: str) -> None:
    if t.shape[dim] != size:
        raise ValueError(
            f"{name} has size {t.shape[dim]} in dim {dim} (shape {tuple(t.shape)}); "
            f"expected {size} ({what})"
        )


def check_unit_stride(name: str, t: torch.Tensor) -> None:
    if t.numel() > 0 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim (stride {t.stride(-1)})")


def check_rows_contiguous(name: str, t: torch.Tensor) -> None:
    """Every dim after the first is laid out densely, so a row is one contiguous block."""
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expected:
            raise ValueError(
                f"{name} must be dense after its first dim (shape {tuple(t.shape)}, "
                f"strides {t.stride()})"
            )
        expected *= size


def check_fp8_supported(name: str, dtype: torch.dtype, device: torch.device) -> None:
    """e4m3fnuz is AMD's flavour: NVIDIA compiles only e4m3fn (the interpreter takes both)."""
    if dtype == torch.float8_e4m3fnuz and device.type == "cuda" and torch.version.hip is None:
        raise ValueError(f"{name}: float8_e4m3fnuz is supported on ROCm only; use float8_e4m3fn")


def check_kv_scale(
    kv_cache: torch.Tensor, kv_scale: torch.Tensor | None
) -> torch.Tensor | None:
    """``kv_scale`` is present (P, PS) fp32 exactly when the cache is fp8."""
    if is_fp8(kv_cache.dtype):
        check_fp8_supported("kv_cache", kv_cache.dtype, kv_cache.device)
        if kv_scale is None:
            raise ValueError(f"kv_cache is {kv_cache.dtype}: kv_scale (P, PS) fp32 is required")
        check_tensor("kv_scale", kv_scale, 2, (torch.float32,), kv_cache.device)
        if tuple(kv_scale.shape) != tuple(kv_cache.shape[:2]):
            raise ValueError(
                f"kv_scale has shape {tuple(kv_scale.shape)}; expected {tuple(kv_cache.shape[:2])}"
                " (one scale per stored row)"
            )
        return kv_scale
    if kv_scale is not None:
        raise ValueError(f"kv_scale is only used with fp8 caches; kv_cache is {kv_cache.dtype}")
    return None


def check_kv_cache(kv_cache: object, device: torch.device | None = None) -> torch.Tensor:
    kv = check_tensor("kv_cache", kv_cache, 3, KV_DTYPES, device)
    check_unit_stride("kv_cache", kv)
    if kv.shape[1] == 0 or kv.shape[2] == 0:
        raise ValueError(f"kv_cache has an empty page or row: shape {tuple(kv.shape)}")
    return kv


def check_paged_lengths(
    block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int, num_pages: int
) -> None:
    """Value check: every length fits its block-table row and every page it uses is in the pool."""
    if not value_checks_enabled() or seq_lens.numel() == 0:
        return
    lens = seq_lens.to(torch.int64)
    if bool((lens < 0).any()):
        raise ValueError(f"seq_lens has negative entries: {seq_lens.tolist()[:16]}")
    capacity = block_table.shape[1] * page_size
    if int(lens.max()) > capacity:
        raise ValueError(
            f"block table too short: a sequence of length {int(lens.max())} needs "
            f"{-(-int(lens.max()) // page_size)} pages of {page_size} tokens, "
            f"but block_table has {block_table.shape[1]} columns"
        )
    pages_used = (lens + page_size - 1) // page_size  # (N,)
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    used = cols[None, :] < pages_used[:, None]  # (N, max_pages)
    ids = block_table[used]
    if ids.numel() and bool(((ids < 0) | (ids >= num_pages)).any()):
        raise ValueError(
            f"block_table refers to pages outside the pool [0, {num_pages}) for used positions"
        )


def check_index_range(name: str, index: torch.Tensor, size: int, allow_neg1: bool) -> None:
    """Value check: indices lie in [0, size) (or are -1 where a skip is allowed)."""
    if not value_checks_enabled() or index.numel() == 0:
        return
    low = -1 if allow_neg1 else 0
    bad = (index < low) | (index >= size)
    if bool(bad.any()):
        first = index[bad][:4].tolist()
        allowed = f"[0, {size})" + (" or -1" if allow_neg1 else "")
        raise ValueError(f"{name} has entries outside {allowed}: e.g. {first}")
