"""ROCm backend: RCCL (torch's "nccl" on ROCm). Profile bw1000 is the Hygon BW1000 DCU (gfx936):
64-wide wavefronts and no native fp8, so its KV stays bf16. MI300-class gfx942 uses e4m3fnuz."""

from __future__ import annotations

import torch

from splash.backends.base import BaseBackend, register_backend
from splash.backends.cuda import CUDABackend


def _gfx_arch() -> str:
    if not torch.cuda.is_available():
        return ""
    props = torch.cuda.get_device_properties(0)
    return str(getattr(props, "gcnArchName", "")).split(":")[0]


@register_backend
class ROCmBackend(BaseBackend):
    name = "rocm"
    dist_backend = "nccl"  # RCCL under the same name
    wave_size = 64
    TUNING = {
        # MFMA takes 16-row tiles; not yet tuned on hardware
        "mla_decode": {
            "default": {
                "BLOCK_N": 32, "BLOCK_H": 16, "num_warps": 4, "num_stages": 1,
                "programs_per_sm": 2, "split_overhead_tokens": 128, "min_split_tokens": 256,
                "many_heads": {"BLOCK_H": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1},
            },
        },
        "mla_extend": {"default": {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}},
        "mha_extend": {"default": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}},
        "fused_moe": CUDABackend.TUNING["fused_moe"],  # not yet tuned on ROCm: CUDA's
    }

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available() and torch.version.hip is not None

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))

    def detect_profile(self) -> str:
        return "bw1000"

    @property
    def fp8_dtype(self) -> torch.dtype | None:
        arch = _gfx_arch()
        if arch.startswith("gfx936") or self.profile_name == "bw1000":
            return None  # no native fp8 on the DCU
        return torch.float8_e4m3fnuz

    def synchronize(self) -> None:
        torch.cuda.synchronize()
