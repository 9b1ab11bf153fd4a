"""Device and dtype settings of the kernel tests.

CPU tier (``make test``, ``-m "not gpu"``): kernels run under ``TRITON_INTERPRET=1`` in fp32 and
fp16 (plus fp8 KV with an fp16 query: the interpreter converts fp8 exactly); with a GPU and no
interpreter the same tests run compiled on the GPU. The interpreter computes bf16 wrongly, so
bf16 and fp8-with-bf16 run only in the GPU tier (``-m gpu``), on CUDA.

Tolerances (outputs compared after casting to fp32; lse is always fp32), against fp64 references
that use exactly the stored (dequantised) KV values:
- fp32: atol = rtol = 1e-5 (fp32 dots in IEEE mode; observed errors ~1e-6).
- fp16: atol = rtol = 5e-3 on out: p is rounded to fp16 before the p·V dot and out is stored in
  fp16, two roundings of <= 2^-11 relative each on values of size ~1-3; lse 1e-4.
- bf16: atol = rtol = 2e-2 on out: the same two roundings at bf16's 2^-8 relative precision
  (<= 2^-9 each), plus summation order, leave ~5x margin; lse 2e-3 (fp32 softmax statistics
  over bf16 scores).
- fp8 KV: the reference dequantises the very fp8 values and scales the kernel reads, and the
  kernel widens them exactly, so quantisation error is not measured here and the tolerance is
  that of the query dtype (fp16 or bf16). Quantisation itself is tested in test_kv_cache_ops.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernel_data import SETTING_PARAMS, Setting, compiled_gpu, make_setting  # noqa: E402


@pytest.fixture
def device() -> torch.device:
    """CUDA when a GPU is present and the interpreter is off, else the CPU (interpreter)."""
    return torch.device("cuda") if compiled_gpu() else torch.device("cpu")


@pytest.fixture
def gpu_device() -> torch.device:
    if not compiled_gpu():
        pytest.skip("needs a CUDA GPU with TRITON_INTERPRET unset")
    return torch.device("cuda")


@pytest.fixture(params=SETTING_PARAMS)
def setting(request) -> Setting:
    """One (device, query dtype, KV dtype, tolerances) combination."""
    return make_setting(request.param)
