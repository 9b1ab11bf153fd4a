"""Backend base class and registry."""

from __future__ import annotations

import copy
import json
import os
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from splash.backends.dtypes import TORCH_DTYPES, dtype_name
from splash.backends.profiles import HardwareProfile, load_profile
from splash.errors import ConfigError
from splash.logging_utils import get_logger

logger = get_logger("splash.backends")

_REGISTRY: dict[str, type[BaseBackend]] = {}

def kernel_overrides() -> dict[str, dict[str, Any]]:
    """``SPLASH_KERNEL_CONFIG``: launch parameters over the tuning tables', per kernel, e.g.
    ``{"topk": {"PARTS": 4}}`` (the kernel checks the names and values when it launches)."""
    text = os.environ.get("SPLASH_KERNEL_CONFIG", "").strip()
    if not text:
        return {}
    try:
        table = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"SPLASH_KERNEL_CONFIG is not JSON ({exc})") from None
    if not isinstance(table, dict) or not all(isinstance(v, dict) for v in table.values()):
        raise ConfigError('SPLASH_KERNEL_CONFIG must map kernels to parameter objects, e.g. '
                          '{"topk": {"PARTS": 4}}')
    return table


class BaseBackend(ABC):
    """Contract: one accelerator family.

    - ``device(local_rank)``: the torch device a worker of that local rank uses.
    - ``dist_backend``: torch.distributed backend name (gloo / nccl; nccl on ROCm is RCCL).
    - ``dtypes``: activation/weight dtypes it computes correctly; ``kv_dtypes``: KV-cache dtypes
      (those, plus ``fp8_dtype``, the fp8 flavour, or None); ``check_dtypes`` validates a pair.
    - ``wave_size``: threads per warp/wavefront (32 NVIDIA, 64 AMD/DCU).
    - ``TUNING``: per-kernel launch parameters (``kernel_config``), so tuning never lives in
      kernel code: a launcher called without a config reads its device's table
      (``device_tuning``).
    - ``profile``: the hardware profile feeding the cost model.
    """

    name: ClassVar[str]
    dist_backend: ClassVar[str]
    wave_size: ClassVar[int] = 32
    #: per kernel, per profile: launch parameters; "default" applies when no profile entry exists
    TUNING: ClassVar[dict[str, dict[str, dict[str, Any]]]] = {}

    def __init__(self, profile: str | None = None, calibration: str | None = None) -> None:
        self.profile_name = profile or self.detect_profile()
        self.profile: HardwareProfile = load_profile(self.profile_name, calibration)

    @classmethod
    @abstractmethod
    def is_available(cls) -> bool:
        """Whether this backend can run on this machine."""

    @abstractmethod
    def device(self, local_rank: int = 0) -> torch.device: ...

    @abstractmethod
    def detect_profile(self) -> str:
        """The hardware profile name for the device present."""

    @property
    def fp8_dtype(self) -> torch.dtype | None:
        return None

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.float32, torch.float16, torch.bfloat16)

    #: why a dtype this backend leaves out of ``dtypes`` is left out (shown in the error)
    dtype_note: ClassVar[str] = ""

    @property
    def kv_dtypes(self) -> tuple[torch.dtype, ...]:
        return self.dtypes + ((self.fp8_dtype,) if self.fp8_dtype is not None else ())

    def check_dtypes(self, dtype: str, kv_dtype: str | None = None) -> tuple[str, str]:
        """Canonical names (fp32, fp16, bf16, fp8) of an activation dtype and a KV dtype this
        backend runs, or a ConfigError saying what it runs. The KV cache holds the activation
        dtype (the attention kernels read both alike) or fp8 where the hardware has it."""
        ok = [n for n, t in TORCH_DTYPES.items() if t in self.dtypes]
        name = dtype_name(dtype)
        if name not in TORCH_DTYPES:  # unknown, or fp8 (a KV dtype only)
            raise ConfigError(f"unknown dtype {dtype!r}; use one of {', '.join(ok)}")
        if TORCH_DTYPES[name] not in self.dtypes:
            note = f" ({self.dtype_note})" if self.dtype_note else ""
            raise ConfigError(f"dtype {name} is not supported on the {self.name} backend{note}; "
                              f"use {' or '.join(ok)}")
        kv_ok = [name] + (["fp8"] if self.fp8_dtype is not None else [])
        if kv_dtype is None:
            return name, name
        kv = dtype_name(kv_dtype)
        if kv is None:
            raise ConfigError(f"unknown kv_dtype {kv_dtype!r}; use {' or '.join(kv_ok)}")
        if kv == "fp8" and self.fp8_dtype is None:
            raise ConfigError(f"kv_dtype fp8 is not supported on the {self.name} backend "
                              f"({self.profile_name} has no fp8 type); use {' or '.join(kv_ok)}")
        if kv not in kv_ok:
            raise ConfigError(f"kv_dtype {kv} does not match dtype {name}: the KV cache holds "
                              f"the activation dtype{' or fp8' if len(kv_ok) > 1 else ''}; use "
                              f"{' or '.join(kv_ok)} (or change --dtype)")
        return name, kv

    def kernel_config(self, kernel: str) -> dict[str, Any]:
        """Launch parameters for ``kernel`` on this backend's profile, with the entries of
        ``SPLASH_KERNEL_CONFIG`` (JSON: kernel -> {parameter: value}) over them."""
        table = self.TUNING.get(kernel, {})
        merged = dict(table.get("default", {}))
        merged.update(table.get(self.profile_name, {}))
        merged.update(kernel_overrides().get(kernel, {}))
        return merged

    def synchronize(self) -> None:
        """Wait for queued device work (no-op on CPU)."""

    def describe(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "profile": self.profile_name,
            "dist_backend": self.dist_backend,
            "wave_size": self.wave_size,
            "kv_dtypes": [str(d).replace("torch.", "") for d in self.kv_dtypes],
        }


def device_tuning(device: torch.device, kernel: str) -> dict[str, Any]:
    """The "default" entry of ``kernel`` in the tuning table of the backend that drives
    ``device`` (CPU, CUDA, or ROCm under a HIP build of torch): what a launcher uses when its
    caller passes no config of its own."""
    name = "cpu" if device.type == "cpu" else ("rocm" if torch.version.hip is not None else "cuda")
    return copy.deepcopy(_REGISTRY[name].TUNING.get(kernel, {}).get("default", {}))


def register_backend(cls: type[BaseBackend]) -> type[BaseBackend]:
    _REGISTRY[cls.name] = cls
    return cls


def available_backends() -> list[str]:
    return [name for name, cls in _REGISTRY.items() if cls.is_available()]


def get_backend(
    name: str = "auto", profile: str | None = None, calibration: str | None = None
) -> BaseBackend:
    """The backend ``name`` ("auto" picks rocm, then cuda, then cpu, and logs the choice)."""
    if name == "auto":
        for candidate in ("rocm", "cuda", "cpu"):
            if _REGISTRY[candidate].is_available():
                name = candidate
                break
        backend = _REGISTRY[name](profile, calibration)
        logger.info("backend=auto chose %s (profile %s)", name, backend.profile_name)
        return backend
    if name not in _REGISTRY:
        raise ConfigError(f"unknown backend {name!r}; choose from {sorted(_REGISTRY)} or 'auto'")
    if not _REGISTRY[name].is_available():
        raise ConfigError(
            f"backend {name!r} is not available on this machine; available: {available_backends()}"
        )
    return _REGISTRY[name](profile, calibration)
