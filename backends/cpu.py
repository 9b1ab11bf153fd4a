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
        # small tiles keep the interpreter fast; balanced splits as on CUDA, so the engine's
        # CPU tests run the path GPUs take (the plan once per forward), and page ids gathered
        # from blocks (a GPU option until timed: the tests keep it exercised)
        "mla_decode": {
            "default": {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "max_block_h": 16,
                        "programs_per_sm": 1, "split_overhead_tokens": 16,
                        "min_split_tokens": 32, "balanced": True, "gather_pages": True,
                        "fp8_fp16": False}  # the interpreter widens fp8 exactly to any q dtype
        },
        "mla_extend": {"default": {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1,
                                   "fp8_fp16": False}},
        "mha_extend": {"default": {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}},
        "fused_moe": {"default": {"BLOCK_M": 16, "BLOCK_K": 32, "GROUP_M": 4, "num_warps": 4,
                                  "num_stages": 1, "gate_up": {"BLOCK_N": 32},
                                  "down": {"BLOCK_N": 32}}},
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
