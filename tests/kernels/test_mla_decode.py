"""mla_decode against its fp64 torch reference, and its argument checks."""

from __future__ import annotations

import importlib

import pytest
import torch
from kernel_data import assert_close, assert_lse, block_table, make_setting, paged_cache
from kernel_data import decode_inputs as _inputs

from splash.kernels_triton import mla_decode, mla_decode_ref

decode_module = importlib.import_module("splash.kernels_triton.mla_decode")

# (L, R, page size, heads, lengths): ragged lengths with 0 and 1, pages crossed and filled
# exactly, heads not a multiple of BLOCK_H (16 on the CPU), L/R not powers of two
CASES = {
    "ragged-p16": (32, 16, 16, 20, [0, 1, 35, 77]),
    "npow2-p64": (24, 8, 64, 5, [64, 65, 3]),
    "long-p64": (32, 16, 64, 16, [130]),
}


@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("case", list(CASES))
def test_decode_matches_reference(setting, case, num_splits):
    L, R, PS, H, lens = CASES[case]
    q, kv, scale, table, seq_lens = _inputs(setting, L, R, PS, H, lens)
    sm_scale = (L + R) ** -0.5
    out, lse = mla_decode(q, kv, table, seq_lens, sm_scale, L, kv_scale=scale, num_splits=num_splits)
    ref_out, ref_lse = mla_decode_ref(q, kv, table, seq_lens, sm_scale, L, kv_scale=scale)
    assert out.shape == (len(lens), H, L) and out.dtype == q.dtype
    assert lse.shape == (len(lens), H) and lse.dtype == torch.float32
    assert_close(out, ref_out, setting.atol, setting.rtol)
    assert_lse(lse, ref_lse, setting.lse_tol)
    empty = torch.tensor(lens) == 0
    assert torch.all(out.cpu()[empty] == 0) and torch.all(torch.isneginf(lse.cpu()[empty]))


# launch variants of the tuning tables, run on small shapes: tiles wider than a page, wider
# head groups, deeper pipelines
CONFIGS = {
    "tile-gt-page": {"BLOCK_N": 32},
    "block-h-32": {"BLOCK_H": 32, "BLOCK_N": 32},
    "stages-3": {"BLOCK_N": 16, "num_stages": 3},
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_decode_launch_variants(device, config):
    setting = make_setting("fp32")
    L, R, PS, H, lens = CASES["ragged-p16"]
    q, kv, scale, table, seq_lens = _inputs(setting, L, R, PS, H, lens, seed=1)
    out, lse = mla_decode(q, kv, table, seq_lens, 0.1, L, num_splits=2, config=CONFIGS[config])
    ref_out, ref_lse = mla_decode_ref(q, kv, table, seq_lens, 0.1, L)
    assert_close(out, ref_out, setting.atol, setting.rtol)
    assert_lse(lse, ref_lse, setting.lse_tol)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_kind", ["bf16", "fp8", "fp8-bf16-products", "fp8-cast"])
@pytest.mark.parametrize("heads", [16, 128])
def test_decode_deepseek_shapes(gpu_device, heads, kv_kind):
    """The production shapes (L=512, R=64, page 64) with the default GPU launch parameters (fp8:
    fp16 products, the tile widened in PTX), fp8 KV with products in q's dtype (bf16;
    ``fp8_fp16`` off), and fp16 products with the tile widened by a plain cast."""
    gen = torch.Generator().manual_seed(3)
    L, R, PS = 512, 64, 64
    kv_dtype = torch.float8_e4m3fn if kv_kind.startswith("fp8") else torch.bfloat16
    config = {"fp8-bf16-products": {"fp8_fp16": False},
              "fp8-cast": {"fp8_fp16": True, "fp8_ptx": False}}.get(kv_kind)
    lens = [1, 700, 2500]
    num_pages = sum(-(-n // PS) for n in lens) + 2
    kv, scale = paged_cache(num_pages, PS, L + R, kv_dtype, gpu_device, gen)
    table = block_table(lens, PS, num_pages, gpu_device, gen)
    q = torch.randn(len(lens), heads, L + R, generator=gen).to(torch.bfloat16).to(gpu_device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=gpu_device)
    for splits, cfg in ((1, config), (None, config), (None, {**(config or {}), "balanced": True})):
        out, lse = mla_decode(q, kv, table, seq_lens, 0.1147, L, kv_scale=scale, num_splits=splits,
                              config=cfg)
        # (the many-head Hopper kernel reads q in e4m3 with fp8 KV: the reference takes it so)
        q_read = decode_module.query_as_read(q, kv, L, splits, cfg)
        ref_out, ref_lse = mla_decode_ref(q_read, kv, table, seq_lens, 0.1147, L,
                                          kv_scale=scale)
        assert_close(out, ref_out, 2e-2, 2e-2)
        assert_lse(lse, ref_lse, 2e-3)


def test_decode_empty_batch_does_not_launch(device, monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("launched on an empty batch")

    monkeypatch.setattr(decode_module._mla_decode_kernel, "run", boom)
    q = torch.zeros(0, 4, 48, device=device)
    kv = torch.zeros(3, 16, 48, device=device)
    out, lse = mla_decode(
        q, kv, torch.zeros(0, 2, dtype=torch.int32, device=device),
        torch.zeros(0, dtype=torch.int32, device=device), 0.1, 32,
    )
    assert out.shape == (0, 4, 32) and lse.shape == (0, 4)


def test_num_splits_heuristic():
    cpu = torch.device("cpu")  # 4 "SMs"
    cfg = decode_module.decode_config(
        16, cpu, {"programs_per_sm": 1, "split_overhead_tokens": 128, "min_split_tokens": 256}
    )
    # one long request: fill the 4 SMs once; more splits would add waves and overhead
    assert decode_module.choose_num_splits(1, 1, 4096, cpu, cfg) == 4
    assert decode_module.choose_num_splits(1, 1, 300, cpu, cfg) == 2  # >= 256 tokens per split
    assert decode_module.choose_num_splits(64, 1, 4096, cpu, cfg) == 1  # the batch fills the SMs


@pytest.mark.parametrize("backend", ["cpu", "cuda", "rocm"])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("fp8", [False, True])
def test_backend_tuning_tables_are_valid(backend, heads, fp8):
    """Every backend's mla_decode entry yields a launchable config (and fp8 / many_heads layer)."""
    from splash.backends.base import _REGISTRY

    table = _REGISTRY[backend].TUNING["mla_decode"]
    for entry in table.values():
        cfg = decode_module.decode_config(heads, torch.device("cuda"), entry, fp8=fp8)
        assert cfg["BLOCK_H"] >= 16 and cfg["num_warps"] in (4, 8)
    cuda = _REGISTRY["cuda"].TUNING["mla_decode"]["default"]
    cfg = decode_module.decode_config(heads, torch.device("cuda"), cuda, fp8=fp8)
    assert cfg["BLOCK_H"] == (64 if heads > 32 else 16)


# ------------------------------------------------------------------ bad inputs


def _good(device):
    q = torch.zeros(2, 4, 48, device=device)
    kv = torch.zeros(6, 16, 48, device=device)
    table = torch.zeros(2, 3, dtype=torch.int32, device=device)
    lens = torch.tensor([5, 40], dtype=torch.int32, device=device)
    return dict(q=q, kv_cache=kv, block_table=table, seq_lens=lens, sm_scale=0.1, kv_lora_rank=32)


BAD = {
    "q int dtype": (lambda a: a.update(q=a["q"].int()), "q has dtype"),
    "q/kv dtype mismatch": (lambda a: a.update(q=a["q"].half()), "must match"),
    "q 2-D": (lambda a: a.update(q=a["q"][0]), "q must have 3 dims"),
    "D mismatch": (lambda a: a.update(q=a["q"][..., :40]), "row width"),
    "kv_lora_rank too big": (lambda a: a.update(kv_lora_rank=48), "kv_lora_rank"),
    "block table too short": (lambda a: a.update(block_table=a["block_table"][:, :2]), "block table too short"),
    "page outside pool": (lambda a: a["block_table"].fill_(6), "outside the pool"),
    "negative length": (lambda a: a["seq_lens"].fill_(-1), "negative"),
    "seq_lens float": (lambda a: a.update(seq_lens=a["seq_lens"].float()), "seq_lens has dtype"),
    "seq_lens count": (lambda a: a.update(seq_lens=a["seq_lens"][:1]), "one length per query row"),
    "table rows": (lambda a: a.update(block_table=a["block_table"][:1]), "one row per query row"),
    "fp8 without scale": (lambda a: a.update(kv_cache=a["kv_cache"].to(torch.float8_e4m3fn)), "kv_scale"),
    "scale on non-fp8": (lambda a: a.update(kv_scale=torch.ones(6, 16)), "only used with fp8"),
    "fp8 scale shape": (
        lambda a: a.update(kv_cache=a["kv_cache"].to(torch.float8_e4m3fn), kv_scale=torch.ones(6, 8)),
        "one scale per stored row",
    ),
    "kv strided rows": (lambda a: a.update(kv_cache=torch.zeros(6, 16, 96)[..., ::2]), "contiguous in its last dim"),
    "num_splits 0": (lambda a: a.update(num_splits=0), "num_splits"),
    "bad BLOCK_H": (lambda a: a.update(config={"BLOCK_H": 24}), "BLOCK_H"),
    "device mismatch": (lambda a: a.update(seq_lens=a["seq_lens"].to("meta")), "seq_lens is on"),
}


@pytest.mark.parametrize("bad", list(BAD))
def test_decode_rejects_bad_input(bad):
    args = _good(torch.device("cpu"))
    mutate, message = BAD[bad]
    mutate(args)
    if "kv_scale" in args and args["kv_scale"] is not None:
        args["kv_scale"] = args["kv_scale"].to(args["kv_cache"].device)
    with pytest.raises(ValueError, match=message):
        mla_decode(**args)


# ------------------------------------------------------------------ production shapes on a GPU

# the launcher's default and the head-group kernel with one-page tiles
PRODUCTION_GPU_CONFIGS = {
    "default": None,
    "regular": {"BLOCK_N": 16, "num_warps": 4, "num_stages": 3},
}


@pytest.mark.gpu
@pytest.mark.parametrize("kv_kind", ["bf16", "fp8"])
@pytest.mark.parametrize("config", list(PRODUCTION_GPU_CONFIGS))
def test_decode_production_tails(gpu_device, kv_kind, config):
    """L=512, R=64, page 64, 16 and 20 heads: lengths that are not multiples of BLOCK_N, block
    tables padded with -1 columns, splits of 1, 3, 16 and the launcher's choice. A NaN block is
    freed before each call, so an output element left unwritten is likely NaN and fails."""
    gen = torch.Generator().manual_seed(5)
    L, R, PS = 512, 64, 64
    kv_dtype = torch.float8_e4m3fn if kv_kind == "fp8" else torch.bfloat16
    lens = [1, 63, 64, 65, 127, 511, 513, 700, 2500, 4095]
    num_pages = sum(-(-n // PS) for n in lens) + 5
    kv, scale = paged_cache(num_pages, PS, L + R, kv_dtype, gpu_device, gen)
    table = block_table(lens, PS, num_pages, gpu_device, gen, extra_cols=4)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=gpu_device)
    for heads in (16, 20):
        q = torch.randn(len(lens), heads, L + R, generator=gen).to(torch.bfloat16).to(gpu_device)
        for splits in (1, 3, 16, None):
            cfg = PRODUCTION_GPU_CONFIGS[config]
            # (the Hopper Gluon kernels read q in e4m3 with fp8 KV: the reference takes it so)
            q_read = decode_module.query_as_read(q, kv, L, splits, cfg)
            ref_out, ref_lse = mla_decode_ref(q_read, kv, table, seq_lens, 0.1147, L,
                                              kv_scale=scale)
            poison = torch.full((len(lens), heads, L), float("nan"), dtype=torch.bfloat16,
                                device=gpu_device)
            del poison  # the caching allocator hands this NaN block to the next output
            out, lse = mla_decode(q, kv, table, seq_lens, 0.1147, L, kv_scale=scale,
                                  num_splits=splits, config=cfg)
            torch.cuda.synchronize()
            assert torch.isfinite(out.float()).all(), (heads, splits)
            assert_close(out, ref_out, 2e-2, 2e-2)
            assert_lse(lse, ref_lse, 2e-3)


# ------------------------------------------------------------------ fp8 KV, fp16 products

# config "fp8_fp16" (the CUDA default, off on the CPU unless asked): q clamped to fp16's range and
# cast to fp16, fp8 tiles widened to fp16, p rounded to fp16; fp32 accumulators, out in q's dtype
FP16_PRODUCTS = {"BLOCK_N": 16, "BLOCK_H": 16, "fp8_fp16": True}


def _fp8_inputs(q_dtype, dev, lens, L=32, R=16, PS=16, H=20, seed=21):
    """fp8 KV and a query of fp16-representable values (so an fp32 query loses nothing in the
    fp16 cast and the fp64 reference is exact for it)."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-n // PS) for n in lens) + 3
    kv, scale = paged_cache(num_pages, PS, L + R, torch.float8_e4m3fn, dev, gen)
    table = block_table(lens, PS, num_pages, dev, gen, extra_cols=2)
    q = torch.randn(len(lens), H, L + R, generator=gen).half().to(q_dtype).to(dev)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    return q, kv, scale, table, seq_lens


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16], ids=["q32", "q16"])
def test_decode_fp8_fp16_products(device, q_dtype):
    """The head-group kernel with fp16 products on fp8 KV matches the reference (which dequantises the same
    fp8 values) to fp16 tolerances: tail tiles, a split past a length, an empty request, heads
    not a multiple of BLOCK_H; out keeps q's dtype."""
    L, lens = 32, [0, 1, 35, 77]
    q, kv, scale, table, seq_lens = _fp8_inputs(q_dtype, device, lens)
    out, lse = mla_decode(q, kv, table, seq_lens, 0.2, L, kv_scale=scale, num_splits=3,
                          config=FP16_PRODUCTS)
    ref_out, ref_lse = mla_decode_ref(q, kv, table, seq_lens, 0.2, L, kv_scale=scale)
    assert out.dtype == q_dtype
    assert_close(out, ref_out, 5e-3, 5e-3)
    assert_lse(lse, ref_lse, 1e-4)
    assert torch.all(out.cpu()[0] == 0) and torch.all(torch.isneginf(lse.cpu()[0]))


def test_decode_fp8_fp16_saturates_huge_q(device):
    """A query entry of 1e6 (beyond fp16's 65504) saturates: the output is finite and equals the
    reference for the clamped query (so the clamp happened: unclamped, lse would be ~15x larger)."""
    L, lens = 32, [5, 40]
    q, kv, scale, table, seq_lens = _fp8_inputs(torch.float32, device, lens, H=16, seed=22)
    q[:, 3, 7] = 1e6
    q[1, 5, 2] = -1e6
    out, lse = mla_decode(q, kv, table, seq_lens, 0.2, L, kv_scale=scale, num_splits=2,
                          config=FP16_PRODUCTS)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    clamped = q.clamp(-65504.0, 65504.0)
    ref_out, ref_lse = mla_decode_ref(clamped, kv, table, seq_lens, 0.2, L, kv_scale=scale)
    assert_close(out, ref_out, 5e-3, 5e-3)
    assert_lse(lse, ref_lse, 1e-4)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("heads", [16, 128])
def test_fp8_fp16_is_the_cuda_default(heads, fp8):
    """The launcher's GPU defaults and the CUDA backend's table agree: fp16 products for fp8 KV
    at every head count (the tile widened once for both products), and the CPU defaults leave
    them off; sparse MLA keeps bf16 products with many heads (measured faster there)."""
    from splash.backends.base import _REGISTRY

    cuda = _REGISTRY["cuda"].TUNING["mla_decode"]["default"]
    gpu = torch.device("cuda")
    assert decode_module.decode_config(heads, gpu, None, fp8=fp8) == decode_module.decode_config(
        heads, gpu, cuda, fp8=fp8
    )
    assert decode_module.decode_config(heads, gpu, None, fp8=True)["fp8_fp16"] is True
    sparse = _REGISTRY["cuda"].TUNING["mla_sparse"]["default"]
    assert decode_module.decode_config(heads, gpu, sparse, fp8=True)["fp8_fp16"] is (heads <= 32)
    cpu_cfg = decode_module.decode_config(heads, torch.device("cpu"), None, fp8=True)
    assert cpu_cfg["fp8_fp16"] is False


def test_warp_specialize_is_refused(device):
    q = torch.zeros(1, 16, 48, device=device)
    kv = torch.zeros(1, 16, 48, device=device)
    one = torch.ones(1, 1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="warp_specialize"):
        decode_module.mla_decode(q, kv, one - 1, one[0], 0.3, 32, config={"warp_specialize": True})
