"""The decode and extend records' latent KV pool: DeepSeek-V3 dims, GPU pages, random page
order (``kernel_bench.py``, ``extend_kernels.py``, ``profile_driver.py``; ``dsa_kernels.py`` shares
the dims)."""

from __future__ import annotations

import torch
import triton

L, R, PAGE = 512, 64, 64
D = L + R
SM_SCALE = 0.1147


def paged_pool(batch: int, context: int, kind: str, dev: torch.device, gen: torch.Generator):
    pages_per = triton.cdiv(context, PAGE)
    num_pages = batch * pages_per
    table = torch.randperm(num_pages, device=dev, generator=gen).to(torch.int32)
    table = table.reshape(batch, pages_per)  # random page order
    if kind == "fp8":
        kv = torch.empty(num_pages, PAGE, D, device=dev, dtype=torch.float8_e4m3fn)
        kv.view(torch.uint8).random_(0, 0x7E, generator=gen)  # finite e4m3fn bit patterns
        scale = torch.rand(num_pages, PAGE, device=dev, generator=gen) * 0.01 + 0.005
    else:
        kv = torch.randn(num_pages, PAGE, D, device=dev, dtype=torch.bfloat16, generator=gen)
        scale = None
    return kv, scale, table
