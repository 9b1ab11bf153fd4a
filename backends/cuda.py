"""NVIDIA CUDA backend (profiles h200, b200): NCCL collectives, fp8 e4m3fn KV."""

from __future__ import annotations

import torch

from splash.backends.base import BaseBackend, register_backend


@register_backend
class CUDABackend(BaseBackend):
    name = "cuda"
    dist_backend = "nccl"
    wave_size = 32
    TUNING = {
        "mla_decode": {
            "default": {"BLOCK_N": 64, "BLOCK_H": 16, "num_warps": 4, "num_stages": 2},
            "h200": {"BLOCK_N": 64, "BLOCK_H": 16, "num_warps": 4, "num_stages": 2},
            "b200": {"BLOCK_N": 64, "BLOCK_H": 16, "num_warps": 4, "num_stages": 2},
        },
        "mla_extend": {"default": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 1}},
    }

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available() and torch.version.hip is None

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))

    def detect_profile(self) -> str:
        if not torch.cuda.is_available():
            return "h200"
        name = torch.cuda.get_device_name(0).upper()
        return "b200" if "B200" in name else "h200"

    @property
    def fp8_dtype(self) -> torch.dtype | None:
        return torch.float8_e4m3fn

    def synchronize(self) -> None:
        torch.cuda.synchronize()
