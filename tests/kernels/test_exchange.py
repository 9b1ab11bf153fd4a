"""DOP exchange pack/unpack kernels against torch indexing and permutes (bit-exact)."""

from __future__ import annotations

import pytest
import torch

from splash.kernels_triton import (
    expand_runs,
    expand_runs_ref,
    gather_layer_rows,
    gather_layer_rows_ref,
    gather_rows,
    gather_rows_ref,
    merge_heads_from_ranks,
    merge_heads_from_ranks_ref,
    scatter_layer_rows,
    scatter_rows,
    scatter_rows_ref,
    split_heads_to_ranks,
    split_heads_to_ranks_ref,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int64]


def _data(shape, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen) * 4
    return x.to(dtype).to(device)


def _same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gather_and_scatter_rows(device, dtype):
    x = _data((11, 3, 20), dtype, device)
    index = torch.tensor([4, 0, 10, 4, 7], device=device)  # repeats are fine for a gather
    assert _same(gather_rows(x, index), gather_rows_ref(x, index))
    out = _data((11, 3, 20), dtype, device, seed=1)
    rows = _data((4, 3, 20), dtype, device, seed=2)
    dst = torch.tensor([9, 1, 5, 0], device=device)
    want = scatter_rows_ref(out.clone(), dst, rows)
    assert _same(scatter_rows(out, dst, rows), want)


def test_gather_strided_source_rows(device):
    """A row-sliced view (stride(0) larger than the row) is read in place."""
    base = _data((12, 4, 8), torch.float32, device)
    x = base[::2]  # (6, 4, 8), rows dense, stride(0) = 64
    index = torch.tensor([5, 1, 3], device=device)
    assert _same(gather_rows(x, index), x[index])


def test_pack_into_and_unpack_from_a_column_slice(device):
    """A switch packs each pool into its columns of one wider buffer and unpacks from there."""
    x = _data((7, 12), torch.float32, device)
    index = torch.tensor([4, 0, 6], device=device)
    buf = torch.zeros(3, 20, device=device)
    gather_rows(x, index, out=buf[:, 5:17])
    want = torch.zeros(3, 20, device=device)
    want[:, 5:17] = x[index]
    assert _same(buf, want)
    out = torch.zeros(7, 12, device=device)
    scatter_rows(out, index, buf[:, 5:17])
    assert _same(out, scatter_rows_ref(torch.zeros(7, 12, device=device), index, x[index]))
    with pytest.raises(ValueError, match="out is"):
        gather_rows(x, index, out=buf[:, :11])


def test_wide_rows_use_several_column_blocks(device):
    x = _data((5, 9, 300), torch.float16, device)  # 2700 elements per row > BLOCK_W
    index = torch.tensor([3, 1], device=device)
    assert _same(gather_rows(x, index, config={"BLOCK_W": 512}), x[index])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T", [1, 2, 4])
def test_split_and_merge_heads(device, dtype, T):
    x = _data((7, 8, 12), dtype, device)  # (n, H, d)
    split = split_heads_to_ranks(x, T)
    assert _same(split, split_heads_to_ranks_ref(x, T))
    assert _same(merge_heads_from_ranks(split, T), merge_heads_from_ranks_ref(split, T))
    assert _same(merge_heads_from_ranks(split, T), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8], ids=["fp32", "bytes"])
def test_layer_rows_pack_every_layer_at_once(device, dtype):
    """Three layers' pools stacked at one stride (every other layer of a stack of six, as a
    group takes consecutive layers of a strided view): the same rows of each land in
    per-layer column blocks of a packed buffer (blocks padded, a column slice of a wider
    row), and scatter back into a fresh stack bit for bit."""
    g = torch.Generator().manual_seed(3)
    stack = (torch.rand(6, 10, 4, 5, generator=g) * 250).to(dtype).to(device)
    x = stack[::2].reshape(3, 40, 5)  # (L, N rows, W): a strided layer dim
    index = torch.tensor([7, 0, 39, 12], device=device)
    buf = torch.zeros(4, 2 + 3 * 8, dtype=dtype, device=device)  # 8 = the padded block
    out = buf[:, 2:].view(4, 3, 8)[:, :, :5]
    gather_layer_rows(x, index, out)
    assert torch.equal(out, gather_layer_rows_ref(x, index))
    assert not buf[:, :2].any() and not buf[:, 2:].view(4, 3, 8)[:, :, 5:].any()
    fresh = torch.zeros_like(stack)
    target = fresh[::2].reshape(3, 40, 5)
    scatter_layer_rows(target, index, out)
    assert torch.equal(target[:, index], x[:, index])
    assert int((target != 0).sum()) == int((x[:, index] != 0).sum())
    with pytest.raises(ValueError, match="rows have shape"):
        gather_layer_rows(x, index, buf[:, :10].view(4, 2, 5))


@pytest.mark.parametrize("seed", [0, 1])
def test_expand_runs(device, seed):
    """Runs of 1 to 600 rows (several programs per run) at scattered starts, in any order:
    every row's index, runs back to back."""
    g = torch.Generator().manual_seed(seed)
    n = torch.randint(1, 600, (9,), generator=g)
    start = torch.randperm(10_000, generator=g)[:9] * 7
    first = torch.cumsum(n, 0) - n
    runs = torch.stack([start, first, n], 1).to(device)
    total = int(n.sum())
    out = expand_runs(runs, total, int(n.max()))
    assert torch.equal(out.cpu(), expand_runs_ref(runs, total).cpu())
    assert expand_runs(runs[:0], 0, 0).shape == (0,)
    with pytest.raises(ValueError, match="expected \\(R, 3\\)"):
        expand_runs(runs[:, :2].contiguous(), total, int(n.max()))


def test_empty_exchange(device):
    x = torch.zeros(0, 4, 6, device=device)
    assert split_heads_to_ranks(x, 2).shape == (2, 0, 2, 6)
    assert gather_rows(torch.zeros(3, 5, device=device), torch.zeros(0, dtype=torch.int64, device=device)).shape == (0, 5)


def test_exchange_rejects_bad_input():
    x = torch.zeros(6, 4, 8)
    with pytest.raises(ValueError, match="index has entries outside"):
        gather_rows(x, torch.tensor([6]))
    with pytest.raises(ValueError, match="index has dtype"):
        gather_rows(x, torch.tensor([0.0]))
    with pytest.raises(ValueError, match="dense after its first dim"):
        gather_rows(x.transpose(1, 2), torch.tensor([0]))
    with pytest.raises(ValueError, match="rows are torch.float16"):
        scatter_rows(x, torch.tensor([0]), torch.zeros(1, 4, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="rows have shape"):
        scatter_rows(x, torch.tensor([0, 1]), torch.zeros(1, 4, 8))
    with pytest.raises(ValueError, match="do not split evenly"):
        split_heads_to_ranks(x, 3)
    with pytest.raises(ValueError, match="positive int"):
        split_heads_to_ranks(x, 0)
    with pytest.raises(ValueError, match="expected T=2"):
        merge_heads_from_ranks(torch.zeros(3, 2, 2, 8), 2)
    with pytest.raises(ValueError, match="must have 3 dims"):
        split_heads_to_ranks(torch.zeros(4, 8), 2)
