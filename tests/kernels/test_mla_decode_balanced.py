"""mla_decode's balanced splits (``config["balanced"]``) against the fp64 torch reference."""

from __future__ import annotations

import importlib

import pytest
import torch
from kernel_data import (
    assert_close,
    assert_lse,
    compiled_gpu,
    decode_inputs,
    fp8_query,
    make_setting,
)

from splash.kernels_triton import mla_decode, mla_decode_ref

decode_module = importlib.import_module("splash.kernels_triton.mla_decode")


def _balanced_plan(lens, programs, min_tiles, block_n):
    """The split plan the balanced launch is documented to follow, in Python: per request its
    split count and token ranges."""
    tiles = [-(-n // block_n) for n in lens]
    hi = max(-(-sum(tiles) // max(programs - len(lens), 1)), min_tiles)
    lo = max(-(-sum(tiles) // programs), min_tiles) if programs > len(lens) + 1 else hi
    w = next((w for w in range(lo, hi) if sum(max(-(-t // w), 1) for t in tiles) <= programs),
             hi)  # the fewest tiles a split keeping the splits within the programs
    plan = []
    for n, t in zip(lens, tiles):
        splits = max(-(-t // w), 1)
        per = -(-t // splits) * block_n
        plan.append([(j * per, min(j * per + per, n)) for j in range(splits)])
    return plan


# (lengths, programs per SM on the CPU's 4 "SMs", heads): one long request among short ones,
# empty requests, a lone request split many ways, more requests than one 256-wide pass of the
# plan (one of them long enough to split), and requests near half the programs (the bound
# ceil(T / (P - N)) would give each one split, 7 programs of 16; filled, two each)
BALANCED = {
    "half-the-programs": ([64] * 7, 4, 4),
    "long-among-short": ([3, 300, 0, 17, 64, 1, 40], 8, 20),
    "lone-long": ([250], 4, 20),
    "many-requests": ([(7 * i) % 23 for i in range(259)] + [90], 100, 4),
    "two-long-among-short": ([3, 300, 0, 170, 64, 1, 40], 8, 20),  # two split counts
}


@pytest.mark.parametrize("case", list(BALANCED))
def test_balanced_splits_match_reference(case):
    """The default launch splits the batch by its total work (a long request gets many splits,
    short ones one each, which write the output directly); every request's result is the
    reference's, and the plan gives at most ``programs`` splits with work."""
    lens, per_sm, H = BALANCED[case]
    setting = make_setting("fp32")
    L, R, PS = 32, 16, 16
    q, kv, scale, table, seq_lens = decode_inputs(setting, L, R, PS, H, lens, seed=4)
    cfg = {"balanced": True, "programs_per_sm": per_sm, "min_split_tokens": 16}
    out, lse = mla_decode(q, kv, table, seq_lens, 0.2, L, config=cfg)
    ref_out, ref_lse = mla_decode_ref(q, kv, table, seq_lens, 0.2, L)
    assert_close(out, ref_out, setting.atol, setting.rtol)
    assert_lse(lse, ref_lse, setting.lse_tol)
    full = decode_module.decode_config(H, setting.device, cfg)
    programs = decode_module.balanced_programs(-(-H // full["BLOCK_H"]), setting.device, full)
    plan = _balanced_plan(lens, programs, full["min_split_tokens"] // full["BLOCK_N"],
                          full["BLOCK_N"])
    assert sum(map(len, plan)) <= max(programs, len(lens))
    assert all(r[0][0] == 0 and r[-1][1] == n for r, n in zip(plan, lens))
    if not compiled_gpu():  # the cases are sized for the CPU's 4 "SMs" and 16-token tiles
        assert max(map(len, plan)) > 1  # the case does split a request


@pytest.mark.parametrize("case", list(BALANCED))
def test_plan_kernel_follows_the_documented_plan(device, case):
    """The plan launch gives program p exactly the p-th split of the documented plan (request,
    split count, token range), no work past the last split, and each request's first split and
    the total for the merge."""
    import torch

    from splash.kernels_triton.mla_decode_plan import _decode_plan_kernel

    lens, per_sm, _ = BALANCED[case]
    block_n, min_tiles = 16, 1
    programs = per_sm * 4
    plan = _balanced_plan(lens, programs, min_tiles, block_n)
    launched = max(programs, len(lens))
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    items = torch.full((launched, 4), -7, dtype=torch.int32, device=device)
    meta = torch.full((len(lens) + 1,), -7, dtype=torch.int32, device=device)
    _decode_plan_kernel[(launched,)](seq_lens, 1, len(lens), programs, min_tiles, items, meta,
                                     BLOCK_N=block_n)
    want = [[i, len(runs), a, b] for i, runs in enumerate(plan) for a, b in runs]
    got = items.cpu().tolist()
    assert got[:len(want)] == want
    assert all(row[0] == len(lens) for row in got[len(want):])
    firsts = [sum(map(len, plan[:i])) for i in range(len(lens) + 1)]
    assert meta.cpu().tolist() == firsts


def test_plan_scope_plans_once_per_lengths(monkeypatch):
    """Inside ``plan_scope`` launches over the same lengths tensor share one plan launch; a
    change to the lengths (in place) or another tensor plans again; every result stays the
    reference's. Outside a scope each launch plans."""
    import torch

    from splash.kernels_triton import plan_scope

    plan_kernel = decode_module._decode_plan_kernel
    launches = []
    real_run = plan_kernel.run

    def counting(*args, **kwargs):
        launches.append(1)
        return real_run(*args, **kwargs)

    monkeypatch.setattr(plan_kernel, "run", counting)
    setting = make_setting("fp32")
    L, R, PS, H = 32, 16, 16, 4
    lens = [3, 200, 17, 64]
    q, kv, scale, table, seq_lens = decode_inputs(setting, L, R, PS, H, lens, seed=9)
    cfg = {"balanced": True, "programs_per_sm": 4, "min_split_tokens": 16}

    def check(seq_lens):
        out, lse = mla_decode(q, kv, table, seq_lens, 0.2, L, config=cfg)
        ref_out, ref_lse = mla_decode_ref(q, kv, table, seq_lens, 0.2, L)
        assert_close(out, ref_out, setting.atol, setting.rtol)
        assert_lse(lse, ref_lse, setting.lse_tol)

    with plan_scope():
        check(seq_lens)
        check(seq_lens)  # the second layer reuses the plan
        assert len(launches) == 1
        seq_lens[1] = 130  # the next step's lengths, written in place
        check(seq_lens)
        check(seq_lens.clone())  # another tensor
        assert len(launches) == 3
    check(seq_lens)
    check(seq_lens)
    assert len(launches) == 5
    with torch.inference_mode(), plan_scope():  # as the engine runs: no version counters
        frozen = seq_lens.clone()
        check(frozen)
        check(frozen)
    assert len(launches) == 6


@pytest.mark.parametrize("case,low", [("long-among-short", True),
                                      ("two-long-among-short", "mixed"), ("lone-long", True)])
def test_balanced_partials_in_the_output_dtype(setting, case, low, monkeypatch):
    """``low_partials``: the partial rows of requests of at most ``low`` splits (True: all) in
    a 16-bit output's own dtype, the rest in fp32 (fp32 outputs keep fp32 throughout), merged
    to the reference's result ("mixed": the fewest splits a split request has, so longer ones
    keep fp32). The rows of the buffer a request must not use are set to NaN before the merge,
    so a write to or a read from the wrong one shows in the output."""
    seen = []
    merge = decode_module._merge_into

    def poisoned(outs, lses, out, lse, ranges=None, low=None, **kw):
        rows = low[0] if low is not None else outs
        most = low[1] if low is not None else 0
        for a, b in zip(ranges[:-1].tolist(), ranges[1:].tolist()):
            if b - a > 1:
                seen.append(b - a <= most)
                if rows is not outs:  # (fp32 outputs: one buffer)
                    (outs if b - a <= most else rows)[a:b] = float("nan")
        assert outs.dtype == torch.float32 and rows.dtype == (q.dtype if most else torch.float32)
        merge(outs, lses, out, lse, ranges=ranges, low=low, **kw)

    monkeypatch.setattr(decode_module, "_merge_into", poisoned)
    lens, per_sm, H = BALANCED[case]
    L, R, PS = 32, 16, 16
    q, kv, scale, table, seq_lens = decode_inputs(setting, L, R, PS, H, lens, seed=5)
    cfg = {"balanced": True, "programs_per_sm": per_sm, "min_split_tokens": 16}
    if low == "mixed":  # this device's plan: the fewest splits of a split request
        full = decode_module.decode_config(H, setting.device, cfg)
        programs = decode_module.balanced_programs(-(-H // full["BLOCK_H"]), setting.device,
                                                   full)
        min_tiles = max(1, full["min_split_tokens"] // full["BLOCK_N"])
        counts = [len(p) for p in _balanced_plan(lens, programs, min_tiles, full["BLOCK_N"])]
        low = min(c for c in counts if c > 1)
        assert max(counts) > low
    cfg["low_partials"] = low
    out, lse = mla_decode(q, kv, table, seq_lens, 0.2, L, kv_scale=scale, config=cfg)
    low16 = q.dtype != torch.float32
    # the 16-bit rows take every split request (True), or some but not all ("mixed")
    assert seen and set(seen) == ({low16} if low is True or not low16 else {True, False})
    ref_out, ref_lse = mla_decode_ref(q, kv, table, seq_lens, 0.2, L, kv_scale=scale)
    assert_close(out, ref_out, setting.atol, setting.rtol)
    assert_lse(lse, ref_lse, setting.lse_tol)


_GLUON_CASES = [  # (module, setting, heads, page size, config)
    *[("tokens", name, H, PS, cfg) for name in ("fp16", "bf16", "fp16-fp8kv", "bf16-fp8kv")
      for H, PS, cfg in [(16, 64, {}), (5, 128, {}), (16, 64, {"low_partials": 2}),
                         (16, 128, {"programs_per_sm": 8})]],
    *[("heads", name, H, PS, cfg) for name in ("fp16", "bf16")
      for H, PS, cfg in [(128, 64, {}), (64, 128, {}), (128, 64, {"low_partials": 2}),
                         (40, 64, {"programs_per_sm": 4})]],
    # e4m3 KV at many heads: values widened by a warpgroup of their own
    *[("heads_fp8_ws", name, H, PS, cfg) for name in ("fp16-fp8kv", "bf16-fp8kv")
      for H, PS, cfg in [(128, 64, {}), (64, 128, {}), (128, 64, {"low_partials": 2}),
                         (40, 64, {"programs_per_sm": 4})]],
]


@pytest.mark.gpu
@pytest.mark.parametrize("module,name,H,PS,cfg", _GLUON_CASES)
def test_gluon_kernels_match_reference(module, name, H, PS, cfg, monkeypatch):
    """On an sm_90 GPU the Gluon kernels (``config["gluon"]``: tokens on M at few heads, heads
    on M at many; 16-bit or e4m3 KV) serve requests empty, shorter than a tile, one page, past one, many
    pages, split or not, with the reference's results, though the pages' unused rows hold
    NaN."""
    setting = make_setting(name)
    # (the few-head form over e4m3 KV is a module of its own, as is heads_fp8_ws)
    form = "tokens_fp8" if module == "tokens" and setting.fp8 else \
        module if module == "heads_fp8_ws" else f"{module}_gluon"
    gluon = importlib.import_module(f"splash.kernels_triton.mla_decode_{form}")
    if not compiled_gpu() or gluon.gluon is None or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels run on a compiled sm_90 GPU with Gluon")
    launches = []
    launch = gluon.launch
    monkeypatch.setattr(gluon, "launch", lambda *a, **k: (launches.append(1), launch(*a, **k)))
    lens = [0, 1, 63, 64, 65, 300, 4096, 1000, 20000]
    q, kv, scale, table, seq_lens = decode_inputs(setting, 512, 64, PS, H, lens, seed=12)
    used = torch.zeros(kv.shape[:2], dtype=torch.bool)
    for row, n in zip(table.tolist(), lens):
        pages = torch.tensor(row[: -(-n // PS)], dtype=torch.long)
        used[pages] = True
        if n % PS:
            used[pages[-1], n % PS:] = False
    unused = ~used.to(kv.device)  # rows past a request's length are never values: NaN
    if kv.element_size() == 1:
        kv.view(torch.uint8)[unused] = 0x7F  # e4m3's NaN
    else:
        kv[unused] = float("nan")
    cfg = {**cfg, "gluon": True, "fp8": {"many_heads": {"gluon": True}}}  # wherever it applies
    out, lse = mla_decode(q, kv, table, seq_lens, 576 ** -0.5, 512, kv_scale=scale, config=cfg)
    assert launches
    atol, rtol, lse_tol = setting.atol, setting.rtol, setting.lse_tol
    if setting.fp8:  # the scores' product reads an e4m3 q
        q_read = decode_module.query_as_read(q, kv, 512, None, cfg)
        torch.testing.assert_close(q_read, fp8_query(q, kv.dtype), rtol=0.13, atol=0)
        q = q_read
        # and sums e4m3 products in Hopper's fp8 accumulator (about 14 bits a partial sum):
        # scores within ~1e-3, as the bf16 settings allow
        atol, rtol, lse_tol = max(atol, 2e-2), max(rtol, 2e-2), max(lse_tol, 2e-3)
    ref_out, ref_lse = mla_decode_ref(q, kv, table, seq_lens, 576 ** -0.5, 512, kv_scale=scale)
    assert_close(out, ref_out, atol, rtol)
    assert_lse(lse, ref_lse, lse_tol)


def test_tma_rows_view_the_paged_cache_row_by_row():
    """The Gluon kernels' TMA descriptors read q as (N * H, D) rows and the paged cache as
    (pages * PS, D) rows, a page's rows end to end, also for a cache that is a view into a
    wider buffer (no copy)."""
    tiles = importlib.import_module("splash.kernels_triton.mla_decode_gluon_tiles")
    wide = torch.arange(5 * 4 * 12, dtype=torch.float32).reshape(5, 4, 12)
    kv = wide[:, :, 2:10]  # (pages 5, PS 4, D 8), rows 12 apart
    q = torch.arange(3 * 2 * 8, dtype=torch.float32).reshape(3, 2, 8)[:, :, :8]
    rows_q, rows_kv = tiles.tma_rows(q, kv)
    assert torch.equal(rows_q, q.reshape(6, 8))
    assert torch.equal(rows_kv, kv.reshape(20, 8)) and rows_kv.data_ptr() == kv.data_ptr()
