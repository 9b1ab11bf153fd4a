"""CPU backend: kernels under the Triton interpreter, collectives over gloo."""

from __future__ import annotations

import torch

from splash.backends.base import BaseBackend, register_backend


@register_backend
class CPUBackend(BaseBackend):
    name = "cpu"
    dist_backend = "gloo"
    wave_size = 1
    dtype_note = "the Triton interpreter computes bf16 wrongly"
    TUNING = {
        # small tiles keep the interpreter fast (= the launchers' CPU defaults; the split
        # count is left to the launcher's wave model, which the cost model's CPU profile fits)
        "mla_decode": {
            "default": {"BLOCK_N": 16, "BLOCK_H": 16, "num_warps": 4, "num_stages": 1}
        },
        "mla_extend": {"default": {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}},
        "kv_write": {"default": {"BLOCK_M": 16, "num_warps": 4}},
        "kv_gather": {"default": {"BLOCK_M": 16, "num_warps": 4}},
        "exchange": {"default": {"BLOCK_M": 4, "BLOCK_W": 1024, "num_warps": 4}},
    }

    @classmethod
    def is_available(cls) -> bool:
        return True

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.float32, torch.float16)  # no bf16: see dtype_note

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cpu")

    def detect_profile(self) -> str:
        return "cpu"
