"""Random paged-KV test data shared by the kernel tests."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from splash.kernels_triton import quantise_rows_ref


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def compiled_gpu() -> bool:
    return torch.cuda.is_available() and not interpreting()


@dataclass(frozen=True)
class Setting:
    name: str
    device: torch.device
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    atol: float
    rtol: float
    lse_tol: float

    @property
    def fp8(self) -> bool:
        return self.kv_dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


_SETTINGS = {
    "fp32": (torch.float32, torch.float32, 1e-5, 1e-5, 1e-5),
    "fp16": (torch.float16, torch.float16, 5e-3, 5e-3, 1e-4),
    "fp16-fp8kv": (torch.float16, torch.float8_e4m3fn, 5e-3, 5e-3, 1e-4),
    "bf16": (torch.bfloat16, torch.bfloat16, 2e-2, 2e-2, 2e-3),
    "bf16-fp8kv": (torch.bfloat16, torch.float8_e4m3fn, 2e-2, 2e-2, 2e-3),
}
CPU_TIER = ("fp32", "fp16", "fp16-fp8kv")
GPU_TIER = ("bf16", "bf16-fp8kv")
SETTING_PARAMS = [*CPU_TIER, *(pytest.param(n, marks=pytest.mark.gpu) for n in GPU_TIER)]


def make_setting(name: str) -> Setting:
    q_dtype, kv_dtype, atol, rtol, lse_tol = _SETTINGS[name]
    if name in GPU_TIER:
        if not compiled_gpu():
            pytest.skip("bf16 / fp8-with-bf16 run on a GPU only (the interpreter gets bf16 wrong)")
        dev = torch.device("cuda")
    else:
        dev = torch.device("cuda") if compiled_gpu() else torch.device("cpu")
    return Setting(name, dev, q_dtype, kv_dtype, atol, rtol, lse_tol)




def paged_cache(
    num_pages: int, page_size: int, dim: int, kv_dtype: torch.dtype, device: torch.device,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A (P, PS, D) cache of N(0, 1) rows (+ per-row scales (P, PS) when ``kv_dtype`` is fp8)."""
    rows = torch.randn(num_pages * page_size, dim, generator=gen)
    if kv_dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        data, scale = quantise_rows_ref(rows, kv_dtype)
        return (
            data.reshape(num_pages, page_size, dim).to(device),
            scale.reshape(num_pages, page_size).to(device),
        )
    return rows.reshape(num_pages, page_size, dim).to(kv_dtype).to(device), None


def block_table(
    lens: list[int], page_size: int, num_pages: int, device: torch.device, gen: torch.Generator,
    extra_cols: int = 1,
) -> torch.Tensor:
    """(N, max_pages) int32 of distinct pages in random order; columns a length does not use
    hold -1, so a kernel that reads past a length would fault or fail the comparison."""
    need = [-(-n // page_size) for n in lens]
    cols = max(need, default=0) + extra_cols
    assert sum(need) <= num_pages, "test pool too small"
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.full((len(lens), cols), -1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[used : used + n].to(torch.int32)
        used += n
    return table.to(device)


def fp8_query(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q as the Gluon fp8 decode kernels read it: e4m3 with a scale a head, dequantised
    (fp32), for the references."""
    data, scale = quantise_rows_ref(q.reshape(-1, q.shape[-1]), dtype)
    return (data.float() * scale[:, None]).view(q.shape)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> None:
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol)


def assert_lse(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """Equal -inf pattern; finite entries within ``tol`` (absolute and relative)."""
    a, e = actual.float().cpu(), expected.float().cpu()
    assert torch.equal(torch.isneginf(a), torch.isneginf(e)), "lse -inf pattern differs"
    finite = torch.isfinite(e)
    torch.testing.assert_close(a[finite], e[finite], atol=tol, rtol=tol)


def decode_inputs(setting: Setting, L: int, R: int, PS: int, H: int, lens: list[int], seed: int = 0):
    """One decode row per request: q (N, H, L+R), the paged cache (+ fp8 scales), the block
    table and the lengths, on the setting's device and dtypes."""
    gen = torch.Generator().manual_seed(seed)
    dev = setting.device
    num_pages = sum(-(-n // PS) for n in lens) + 3
    kv, scale = paged_cache(num_pages, PS, L + R, setting.kv_dtype, dev, gen)
    table = block_table(lens, PS, num_pages, dev, gen)
    q = torch.randn(len(lens), H, L + R, generator=gen).to(setting.q_dtype).to(dev)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    return q, kv, scale, table, seq_lens
