"""Sparse MLA (DeepSeek Sparse Attention's attention half) against its torch reference: both
split forms, slot ids loaded per tile or gathered, the latent dims in one tile or four column
chunks, empty and partly empty selections; and equal to dense decode when it selects the whole
history."""

from __future__ import annotations

import importlib

import pytest
import torch
from kernel_data import (
    assert_close,
    assert_lse,
    block_table,
    compiled_gpu,
    fp8_query,
    make_setting,
    paged_cache,
)

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


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["bf16", "bf16-fp8kv"])
@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("H", [16, 8, 128, 48])
def test_gluon_sparse_matches_reference(H, num_splits, name, monkeypatch):
    """On an sm_90 GPU the Gluon decode kernels gather the selected rows (tokens on M at 16
    heads or fewer, heads on M above 32; bf16 or e4m3 KV, at many heads the e4m3 one widened
    by a warpgroup of its own): 2,100 slots a row (a partial last tile), selections partly
    empty, empty, with a whole tile of -1 and with -1 scattered, over a pool whose
    unselected rows hold NaN."""
    module = "tokens" if H <= 16 else "heads"
    form = "heads_fp8_ws" if module == "heads" and "fp8" in name else f"{module}_gluon"
    gluon = importlib.import_module(f"splash.kernels_triton.mla_decode_{form}")
    if not compiled_gpu() or gluon.gluon is None or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels run on a compiled sm_90 GPU with Gluon")
    launches = []
    launch = gluon.launch
    monkeypatch.setattr(gluon, "launch", lambda *a, **k: (launches.append(k), launch(*a, **k)))
    setting = make_setting(name)
    gen = torch.Generator().manual_seed(9)
    PS, pages, K = 64, 80, 2100
    kv, scale = paged_cache(pages, PS, 576, setting.kv_dtype, setting.device, gen)
    slots = torch.stack([torch.randperm(pages * PS, generator=gen)[:K] for _ in range(5)])
    slots[1, K // 2:] = -1
    slots[2] = -1
    slots[3, ::3] = -1
    slots[4, 64:128] = -1  # the second tile selects nothing
    unused = torch.ones(pages * PS, dtype=torch.bool)
    unused[slots[slots >= 0]] = False
    if scale is None:
        kv.view(-1, 576)[unused.to(setting.device)] = float("nan")
    else:
        kv.view(torch.uint8).view(-1, 576)[unused.to(setting.device)] = 0x7F  # e4m3's NaN
    slots = slots.to(torch.int32).to(setting.device)
    q = torch.randn(5, H, 576, generator=gen).to(setting.q_dtype).to(setting.device)
    out, lse = mla_sparse(q, kv, slots, 576 ** -0.5, 512, kv_scale=scale,
                          num_splits=num_splits,
                          config={"gluon": True, "gluon_min_split_tiles": 0,
                                  "many_heads": {"gluon": True, "gluon_min_split_tiles": 0},
                                  "fp8": {"many_heads": {"fp8_fp16": True,
                                                         "fp8_query": True}}})
    assert launches and launches[0].get("sparse")
    if module == "heads" and scale is not None:  # its scores' product reads an e4m3 q
        q = fp8_query(q, kv.dtype)
    ref_out, ref_lse = mla_sparse_ref(q, kv, slots, 576 ** -0.5, 512, kv_scale=scale)
    assert_close(out, ref_out, setting.atol, setting.rtol)
    assert_lse(lse, ref_lse, setting.lse_tol)
    assert torch.all(out[2] == 0) and torch.all(lse[2] == float("-inf"))
