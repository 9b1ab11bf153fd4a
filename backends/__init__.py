"""Accelerator backends (installed as ``splash.backends``).

A backend says which torch device and torch.distributed backend to use, which KV dtypes the
hardware supports, its wave size, the per-kernel tuning table and the hardware profile that
feeds the cost model. Model, scheduler and layouts reach a backend only through this registry.
"""

from splash.backends import cpu as _cpu  # noqa: F401  (registers)
from splash.backends import cuda as _cuda  # noqa: F401  (registers)
from splash.backends import rocm as _rocm  # noqa: F401  (registers)
from splash.backends.base import BaseBackend, available_backends, device_tuning, get_backend
from splash.backends.base import register_backend as register_backend
from splash.backends.profiles import PROFILES, HardwareProfile, load_profile

__all__ = [
    "BaseBackend",
    "HardwareProfile",
    "PROFILES",
    "available_backends",
    "device_tuning",
    "get_backend",
    "load_profile",
]
