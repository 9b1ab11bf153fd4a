"""Sparse MLA (DeepSeek Sparse Attention's attention half) against its torch reference: both
split forms, slot ids loaded per tile or gathered, the latent dims in one tile or four column
chunks, empty and partly empty selections; and equal to dense decode when it selects the whole
history."""

from __future__ import annotations

import importlib

import pytest
import torch
from kernel_data import assert_close, assert_lse, block_table, make_setting, paged_cache

from splash.kernels_triton import mla_decode, mla_sparse, mla_sparse_ref

sparse_module = importlib.import_module("splash.kernels_triton.mla_sparse")

SPARSE_CASES = {"h20-p16": (32, 16, 16, 20, 12), "npow2-p4": (24, 8, 4, 5, 7)}


def _sparse_inputs(setting, L, R, PS, H, K, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dev = setting.device
    num_pages = 12
    kv, scale = paged_cache(num_pages, PS, L + R, setting.kv_dtype, dev, gen)
    slots = torch.stack([torch.randperm(num_pages * PS, generator=gen)[:K] for _ in range(4)])
    slots[1, K // 2:] = -1  # a partly empty selection
    slots[2] = -1  # nothing selected: out 0, lse -inf
    q = torch.randn(4, H, L + R, generator=gen).to(setting.q_dtype).to(dev)
    return q, kv, scale, slots.to(torch.int32).to(dev)


@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("case", list(SPARSE_CASES))
def test_sparse_matches_reference(setting, case, num_splits, gather):
    """Both split forms, slot ids loaded per tile or gathered from the split's, loaded once
    (``gather_slots``)."""
    L, R, PS, H, K = SPARSE_CASES[case]
    q, kv, scale, slots = _sparse_inputs(setting, L, R, PS, H, K)
    out, lse = mla_sparse(q, kv, slots, 0.15, L, kv_scale=scale, num_splits=num_splits,
                          config={"gather_slots": gather})
    ref_out, ref_lse = mla_sparse_ref(q, kv, slots, 0.15, L, kv_scale=scale)
    assert out.shape == (4, H, L) and out.dtype == q.dtype
    assert_close(out, ref_out, setting.atol, setting.rtol)
    assert_lse(lse, ref_lse, setting.lse_tol)
    assert torch.all(out[2].cpu() == 0)


@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("num_splits", [1, None])
@pytest.mark.parametrize("L", [64, 96])
def test_sparse_in_column_chunks_matches_reference(setting, L, num_splits, gather):
    """The latent dims in four column chunks (``dim_chunks``, latents of 64 columns or more;
    96: the last chunk past the latent, masked)."""
    q, kv, scale, slots = _sparse_inputs(setting, L, 16, 8, 16, 12)
    out, lse = mla_sparse(q, kv, slots, 0.15, L, kv_scale=scale, num_splits=num_splits,
                          config={"gather_slots": gather, "dim_chunks": True})
    ref_out, ref_lse = mla_sparse_ref(q, kv, slots, 0.15, L, kv_scale=scale)
    assert_close(out, ref_out, setting.atol, setting.rtol)
    assert_lse(lse, ref_lse, setting.lse_tol)
    assert torch.all(out[2].cpu() == 0)


def test_sparse_over_the_whole_history_is_dense_decode(device):
    setting = make_setting("fp32")
    gen = torch.Generator().manual_seed(5)
    L, R, PS, H, lens = 32, 16, 4, 4, [5, 19]
    kv, _ = paged_cache(12, PS, L + R, torch.float32, device, gen)
    table = block_table(lens, PS, 12, device, gen)
    q = torch.randn(2, H, L + R, generator=gen).to(device)
    slots = torch.full((2, 24), -1, dtype=torch.int32)
    for n, length in enumerate(lens):
        pos = torch.arange(length)
        slots[n, :length] = table[n].cpu()[pos // PS] * PS + pos % PS
    out, lse = mla_sparse(q, kv, slots.to(device), 0.2, L)
    dense, dense_lse = mla_decode(q, kv, table, torch.tensor(lens, dtype=torch.int32,
                                                                device=device), 0.2, L)
    assert_close(out, dense, setting.atol, setting.rtol)
    assert_lse(lse, dense_lse, setting.lse_tol)


@pytest.mark.parametrize("case", list(SPARSE_CASES))
def test_sparse_partials_in_the_output_dtype(setting, case, monkeypatch):
    """``low_partials``: split partials in a 16-bit output's own dtype (fp32 outputs keep
    fp32), merged to the reference's result."""
    seen = []
    merge = sparse_module._merge_into
    monkeypatch.setattr(sparse_module, "_merge_into",
                        lambda outs, *a, **kw: (seen.append(outs.dtype), merge(outs, *a, **kw)))
    L, R, PS, H, K = SPARSE_CASES[case]
    q, kv, scale, slots = _sparse_inputs(setting, L, R, PS, H, K, seed=3)
    out, lse = mla_sparse(q, kv, slots, 0.15, L, kv_scale=scale, num_splits=3,
                          config={"low_partials": True})
    assert seen == [q.dtype]  # fp32, fp16 or bf16: the output's
    ref_out, ref_lse = mla_sparse_ref(q, kv, slots, 0.15, L, kv_scale=scale)
    assert_close(out, ref_out, setting.atol, setting.rtol)
    assert_lse(lse, ref_lse, setting.lse_tol)
