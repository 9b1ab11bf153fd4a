"""Random paged-KV test data shared by the kernel tests."""

from __future__ import annotations

import torch

from splash.kernels_triton import quantise_rows_ref


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


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> None:
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol)


def assert_lse(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """Equal -inf pattern; finite entries within ``tol`` (absolute and relative)."""
    a, e = actual.float().cpu(), expected.float().cpu()
    assert torch.equal(torch.isneginf(a), torch.isneginf(e)), "lse -inf pattern differs"
    finite = torch.isfinite(e)
    torch.testing.assert_close(a[finite], e[finite], atol=tol, rtol=tol)
