"""mla_extend (chunked prefill) against its fp64 torch reference, and its argument checks."""

from __future__ import annotations

import pytest
import torch
from kernel_data import assert_close, assert_lse, block_table, make_setting, paged_cache

from splash.kernels_triton import mla_decode, mla_extend, mla_extend_ref

# (L, R, page size, heads, chunk rows per request, prefix per request): prefixes crossing pages,
# a fresh prompt (prefix 0), an empty chunk, one-row chunks, chunks over several row blocks
CASES = {
    "mixed-p16": (32, 16, 16, 3, [5, 20, 1, 0], [0, 13, 40, 7]),
    "npow2-p64": (24, 8, 64, 2, [17, 3], [64, 0]),
    "long-chunk-p64": (32, 16, 64, 2, [40], [70]),
}


def _inputs(setting, L, R, PS, H, rows, prefix, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dev = setting.device
    lens = [n + p for n, p in zip(rows, prefix)]
    num_pages = sum(-(-n // PS) for n in lens) + 2
    kv, scale = paged_cache(num_pages, PS, L + R, setting.kv_dtype, dev, gen)
    table = block_table(lens, PS, num_pages, dev, gen)
    starts = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    q = torch.randn(sum(rows), H, L + R, generator=gen).to(setting.q_dtype).to(dev)
    return q, kv, scale, table, torch.tensor(lens, dtype=torch.int32, device=dev), starts


@pytest.mark.parametrize("case", list(CASES))
def test_extend_matches_reference(setting, case):
    L, R, PS, H, rows, prefix = CASES[case]
    q, kv, scale, table, seq_lens, starts = _inputs(setting, L, R, PS, H, rows, prefix)
    sm_scale = (L + R) ** -0.5
    out, lse = mla_extend(q, kv, table, seq_lens, starts, sm_scale, L, kv_scale=scale)
    ref_out, ref_lse = mla_extend_ref(q, kv, table, seq_lens, starts, sm_scale, L, kv_scale=scale)
    assert out.shape == (sum(rows), H, L) and out.dtype == q.dtype
    assert_close(out, ref_out, setting.atol, setting.rtol)
    assert_lse(lse, ref_lse, setting.lse_tol)


def test_extend_one_row_chunks_equal_decode(device):
    """A chunk of one row per request is a decode step."""
    setting = make_setting("fp32")
    L, R, PS, H = 32, 16, 16, 4
    q, kv, scale, table, seq_lens, starts = _inputs(setting, L, R, PS, H, [1, 1, 1], [0, 16, 30], 2)
    ext, ext_lse = mla_extend(q, kv, table, seq_lens, starts, 0.2, L)
    dec, dec_lse = mla_decode(q, kv, table, seq_lens, 0.2, L, num_splits=1)
    assert_close(ext, dec, 1e-5, 1e-5)
    assert_lse(ext_lse, dec_lse, 1e-5)


@pytest.mark.parametrize("config", [{"BLOCK_M": 32, "BLOCK_N": 16}, {"BLOCK_M": 16, "BLOCK_N": 32}])
def test_extend_launch_variants(device, config):
    setting = make_setting("fp32")
    L, R, PS, H, rows, prefix = CASES["mixed-p16"]
    q, kv, scale, table, seq_lens, starts = _inputs(setting, L, R, PS, H, rows, prefix, 1)
    out, lse = mla_extend(q, kv, table, seq_lens, starts, 0.1, L, config=config)
    ref_out, ref_lse = mla_extend_ref(q, kv, table, seq_lens, starts, 0.1, L)
    assert_close(out, ref_out, setting.atol, setting.rtol)
    assert_lse(lse, ref_lse, setting.lse_tol)


@pytest.mark.parametrize("config", [{}, {"BLOCK_M": 16, "BLOCK_N": 16}])
def test_extend_with_max_rows(device, config):
    """A grid planned for the most rows of a request (the caller's ``max_rows``) gives the same
    result, row blocks of a long chunk included; a request with more rows is refused."""
    setting = make_setting("fp32")
    L, R, PS, H, rows, prefix = CASES["mixed-p16"]
    q, kv, scale, table, seq_lens, starts = _inputs(setting, L, R, PS, H, rows, prefix, 1)
    out, lse = mla_extend(q, kv, table, seq_lens, starts, 0.1, L, config=config,
                          max_rows=max(rows))
    ref_out, ref_lse = mla_extend_ref(q, kv, table, seq_lens, starts, 0.1, L)
    assert_close(out, ref_out, setting.atol, setting.rtol)
    assert_lse(lse, ref_lse, setting.lse_tol)
    with pytest.raises(ValueError, match="max_rows"):
        mla_extend(q, kv, table, seq_lens, starts, 0.1, L, max_rows=max(rows) - 1)


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16], ids=["q32", "q16"])
def test_extend_fp8_fp16_products(device, q_dtype):
    """fp8 KV with fp16 products (config "fp8_fp16", the CUDA default): q (fp16-representable
    values, so an fp32 q loses nothing in the cast) clamped and cast to fp16, fp8 tiles widened
    to fp16, p rounded to fp16; matches the reference to fp16 tolerances, out in q's dtype."""
    L, R, PS, H, rows, prefix = CASES["mixed-p16"]
    setting = make_setting("fp16-fp8kv")
    q, kv, scale, table, seq_lens, starts = _inputs(setting, L, R, PS, H, rows, prefix, 5)
    q = q.to(q_dtype)
    q[2, 1, 3] = 1e6  # beyond fp16's range: saturates at 65504
    out, lse = mla_extend(q, kv, table, seq_lens, starts, 0.2, L, kv_scale=scale,
                          config={"fp8_fp16": True})
    assert out.dtype == q_dtype and torch.isfinite(out).all()
    clamped = q.clamp(-65504.0, 65504.0)
    ref_out, ref_lse = mla_extend_ref(clamped, kv, table, seq_lens, starts, 0.2, L, kv_scale=scale)
    assert_close(out, ref_out, setting.atol, setting.rtol)
    assert_lse(lse, ref_lse, setting.lse_tol)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_kind", ["bf16", "fp8", "fp8-bf16-products"])
def test_extend_deepseek_shapes(gpu_device, kv_kind):
    """L=512, R=64, page 64, 16 heads, default GPU launch parameters (fp8: fp16 products), and
    fp8 KV with products in q's dtype (bf16; ``fp8_fp16`` off)."""
    gen = torch.Generator().manual_seed(4)
    L, R, PS, H = 512, 64, 64, 16
    kv_dtype = torch.float8_e4m3fn if kv_kind.startswith("fp8") else torch.bfloat16
    config = {"fp8_fp16": False} if kv_kind == "fp8-bf16-products" else None
    rows, prefix = [200, 7], [300, 0]
    lens = [n + p for n, p in zip(rows, prefix)]
    num_pages = sum(-(-n // PS) for n in lens) + 2
    kv, scale = paged_cache(num_pages, PS, L + R, kv_dtype, gpu_device, gen)
    table = block_table(lens, PS, num_pages, gpu_device, gen)
    starts = torch.tensor([0, 200, 207], dtype=torch.int32, device=gpu_device)
    q = torch.randn(207, H, L + R, generator=gen).to(torch.bfloat16).to(gpu_device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=gpu_device)
    out, lse = mla_extend(q, kv, table, seq_lens, starts, 0.1147, L, kv_scale=scale,
                          config=config)
    ref_out, ref_lse = mla_extend_ref(q, kv, table, seq_lens, starts, 0.1147, L, kv_scale=scale)
    assert_close(out, ref_out, 2e-2, 2e-2)
    assert_lse(lse, ref_lse, 2e-3)


def test_extend_empty(device):
    q = torch.zeros(0, 2, 48, device=device)
    kv = torch.zeros(2, 16, 48, device=device)
    out, lse = mla_extend(
        q, kv, torch.zeros(1, 1, dtype=torch.int32, device=device),
        torch.zeros(1, dtype=torch.int32, device=device),
        torch.zeros(2, dtype=torch.int32, device=device), 0.1, 32,
    )
    assert out.shape == (0, 2, 32) and lse.shape == (0, 2)


# ------------------------------------------------------------------ bad inputs


def _good():
    return dict(
        q=torch.zeros(5, 2, 48),
        kv_cache=torch.zeros(4, 16, 48),
        block_table=torch.tensor([[0, 1], [2, -1]], dtype=torch.int32),
        seq_lens=torch.tensor([20, 3], dtype=torch.int32),
        q_start_loc=torch.tensor([0, 3, 5], dtype=torch.int32),
        sm_scale=0.1,
        kv_lora_rank=32,
    )


BAD = {
    "q fp64": (lambda a: a.update(q=a["q"].double()), "q has dtype"),
    "q/kv mismatch": (lambda a: a.update(kv_cache=a["kv_cache"].half()), "must match"),
    "D mismatch": (lambda a: a.update(q=a["q"][..., :47]), "row width"),
    "q_start_loc length": (lambda a: a.update(q_start_loc=a["q_start_loc"][:2]), "B \\+ 1"),
    "q_start_loc end": (lambda a: a["q_start_loc"].copy_(torch.tensor([0, 3, 4])), "end at Nq"),
    "q_start_loc decreasing": (lambda a: a["q_start_loc"].copy_(torch.tensor([0, 6, 5])), "non-decreasing"),
    "seq_lens without chunk": (lambda a: a["seq_lens"].copy_(torch.tensor([2, 3])), "include the chunk"),
    "block table too short": (lambda a: a["seq_lens"].copy_(torch.tensor([33, 3])), "block table too short"),
    "page outside pool": (lambda a: a["block_table"].fill_(9), "outside the pool"),
    "q_start_loc float": (lambda a: a.update(q_start_loc=a["q_start_loc"].float()), "q_start_loc has dtype"),
    "table rows": (lambda a: a.update(block_table=a["block_table"][:1]), "one row per request"),
    "fp8 without scale": (lambda a: a.update(kv_cache=a["kv_cache"].to(torch.float8_e4m3fn)), "kv_scale"),
    "bad BLOCK_M": (lambda a: a.update(config={"BLOCK_M": 48}), "BLOCK_M"),
}


@pytest.mark.parametrize("bad", list(BAD))
def test_extend_rejects_bad_input(bad):
    args = _good()
    mutate, message = BAD[bad]
    mutate(args)
    with pytest.raises(ValueError, match=message):
        mla_extend(**args)


def test_cuda_extend_table_is_the_launcher_default():
    """The engine passes the backend's table; on CUDA it equals the launcher's own defaults."""
    from splash.backends.base import _REGISTRY
    from splash.kernels_triton.mla_extend import extend_config

    gpu = torch.device("cuda")
    table = _REGISTRY["cuda"].TUNING["mla_extend"]["default"]
    assert extend_config(gpu, None) == extend_config(gpu, table)
    # fp32 queries get the small tiles whatever the table says (shared memory)
    assert extend_config(gpu, table, fp32_q=True)["BLOCK_N"] == 16
