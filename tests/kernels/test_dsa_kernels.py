"""DeepSeek Sparse Attention kernels against their torch references: the indexer's scores over a
paged key pool, the chunked row top-k (one and several passes, ties, slots), and sparse MLA
and both joined at DeepSeek-V3.2 shapes on a GPU (sparse MLA alone: ``test_mla_sparse.py``)."""

from __future__ import annotations

import pytest
import torch
from kernel_data import assert_close, assert_lse, block_table, make_setting, paged_cache

from splash.kernels_triton import (
    index_scores,
    index_scores_ref,
    mla_sparse,
    mla_sparse_ref,
    topk_rows,
    topk_rows_ref,
)
from splash.kernels_triton.dsa_index import index_config
from splash.kernels_triton.mla_sparse import query_as_read as sparse_query_as_read
from splash.layouts.sparse import topk_indexed

# (index heads, key width, page size, rows per request, prefix per request): decode rows only,
# prefill chunks with prefixes crossing pages and an empty chunk, widths not powers of two
INDEX_CASES = {
    "decode-p4": (8, 32, 4, [1, 1, 1], [0, 9, 40]),
    "extend-p16": (5, 24, 16, [6, 1, 0, 9], [0, 21, 3, 17]),
}
SCORE_TOL = {"fp32": 1e-5, "fp16": 2e-3, "fp16-fp8kv": 2e-3, "bf16": 2e-2, "bf16-fp8kv": 2e-2}


def _index_inputs(setting, HI, I, PS, rows, prefix, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dev = setting.device
    lens = [n + p for n, p in zip(rows, prefix)]
    num_pages = sum(-(-n // PS) for n in lens) + 2
    keys, scale = paged_cache(num_pages, PS, I, setting.kv_dtype, dev, gen)
    table = block_table(lens, PS, num_pages, dev, gen)
    starts = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int32,
                          device=dev)
    q = torch.randn(sum(rows), HI, I, generator=gen).to(setting.q_dtype).to(dev)
    w = torch.randn(sum(rows), HI, generator=gen).to(dev)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    return q, w, keys, scale, table, seq_lens, starts, max(lens) + 5


def _kernel_query(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The queries as the default launch multiplies them: rounded to e4m3 per (row, head)
    where it takes e4m3 products (fp8 keys on sm_89+), else as they are."""
    if keys.dtype == torch.float8_e4m3fn and index_config(keys.device, None)["fp8_dot"]:
        return _e4m3_query(q.float())
    return q


def _assert_scores(actual, expected, tol):
    a, e = actual.float().cpu(), expected.float().cpu()
    assert torch.equal(torch.isneginf(a), torch.isneginf(e)), "unseen-token pattern differs"
    finite = torch.isfinite(e)
    torch.testing.assert_close(a[finite], e[finite], atol=tol, rtol=tol)


@pytest.mark.parametrize("case", list(INDEX_CASES))
def test_index_scores_match_reference(setting, case):
    HI, I, PS, rows, prefix = INDEX_CASES[case]
    q, w, keys, scale, table, lens, starts, T = _index_inputs(setting, HI, I, PS, rows, prefix)
    out = index_scores(q, w, keys, table, lens, starts, I ** -0.5, T, index_scale=scale)
    ref = index_scores_ref(_kernel_query(q, keys), w, keys, table, lens, starts, I ** -0.5, T,
                           index_scale=scale)
    assert out.shape == (sum(rows), T) and out.dtype == torch.float32
    _assert_scores(out, ref, SCORE_TOL[setting.name])


@pytest.mark.parametrize("config", [{"BLOCK_T": 32, "TILES": 1}, {"BLOCK_M_EXTEND": 1},
                                    {"num_warps_extend": 8, "tokens_m": True},
                                    {"BLOCK_M_EXTEND": 8, "TILES": 4}, {"tokens_m": True},
                                    {"tokens_m": True, "BLOCK_M_EXTEND": 1, "BLOCK_T": 16},
                                    {"gather_pages": False}, {"gather_pages": False,
                                                              "TILES": 4},
                                    {"BLOCK_T": 32, "TILES": 128}])  # > 256 pages: loads
def test_index_scores_launch_variants(device, config):
    setting = make_setting("fp32")
    q, w, keys, scale, table, lens, starts, T = _index_inputs(setting, *INDEX_CASES["extend-p16"],
                                                              seed=1)
    out = index_scores(q, w, keys, table, lens, starts, 0.2, T, config=config)
    _assert_scores(out, index_scores_ref(q, w, keys, table, lens, starts, 0.2, T), 1e-5)


@pytest.mark.parametrize("case", list(INDEX_CASES))
def test_index_scores_with_max_rows(device, case):
    """A launch told the most rows of a request (decode: 1) gives the same scores; a request
    with more rows is refused."""
    setting = make_setting("fp32")
    HI, I, PS, rows, prefix = INDEX_CASES[case]
    q, w, keys, scale, table, lens, starts, T = _index_inputs(setting, HI, I, PS, rows, prefix)
    ref = index_scores_ref(q, w, keys, table, lens, starts, 0.2, T)
    _assert_scores(index_scores(q, w, keys, table, lens, starts, 0.2, T, max_rows=max(rows)),
                   ref, 1e-5)
    if max(rows) > 1:
        with pytest.raises(ValueError, match="max_rows"):
            index_scores(q, w, keys, table, lens, starts, 0.2, T, max_rows=max(rows) - 1)
    with pytest.raises(ValueError, match="max_rows"):
        index_scores(q, w, keys, table, lens, starts, 0.2, T, max_rows=0)


def test_index_scores_fp8_fp16_products(device):
    """fp8 keys with fp16 products (the CUDA default): q clamped to fp16's range and cast."""
    setting = make_setting("fp16-fp8kv")
    q, w, keys, scale, table, lens, starts, T = _index_inputs(setting, *INDEX_CASES["decode-p4"],
                                                              seed=2)
    q = q.float()
    out = index_scores(q, w, keys, table, lens, starts, 0.2, T, index_scale=scale,
                       config={"fp8_fp16": True, "fp8_dot": False})
    ref = index_scores_ref(q.half().float(), w, keys, table, lens, starts, 0.2, T,
                           index_scale=scale)
    _assert_scores(out, ref, 2e-3)


def _e4m3_query(q: torch.Tensor) -> torch.Tensor:
    """``q`` rounded as the e4m3 products round it: per (row, head) scaled by amax / 448."""
    q_scale = q.abs().amax(dim=2, keepdim=True).clamp(min=1e-30) / 448.0
    return (q / q_scale).to(torch.float8_e4m3fn).float() * q_scale


@pytest.mark.parametrize("tokens_m", [False, True])
def test_index_scores_fp8_products(device, tokens_m):
    """e4m3 products (``fp8_dot``): the per-(row, head) query scale moves through the relu into
    the head weight. The queries here are e4m3 values times a power of two with 448 at the top,
    so the kernel's rounding is exact: the interpreter rounds fp32 -> e4m3 wrongly when the
    mantissa carries (7.9 -> 4.0), which the GPU test below covers with random queries."""
    if device.type == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 products need sm_89+")
    setting = make_setting("fp16-fp8kv")
    q, w, keys, scale, table, lens, starts, T = _index_inputs(setting, *INDEX_CASES["extend-p16"],
                                                              seed=3)
    gen = torch.Generator().manual_seed(9)
    q8 = torch.randint(0, 0x7E, q.shape, generator=gen, dtype=torch.uint8)
    q8 = q8.view(torch.float8_e4m3fn).float() * torch.where(torch.rand(q.shape, generator=gen)
                                                             < 0.5, -1.0, 1.0)
    q8[..., 0] = 448.0
    q = (q8 * 2.0 ** torch.randint(-8, 3, q.shape[:2], generator=gen)[..., None]).to(q.device)
    out = index_scores(q, w, keys, table, lens, starts, 0.2, T, index_scale=scale,
                       config={"fp8_dot": True, "tokens_m": tokens_m})
    assert torch.equal(_e4m3_query(q), q)
    ref = index_scores_ref(q, w, keys, table, lens, starts, 0.2, T, index_scale=scale)
    # exact products; Hopper's e4m3 tensor cores add them in less than fp32 (~3e-3 relative
    # seen on an H200 with the keys on M), the interpreter in fp32
    _assert_scores(out, ref, 1e-4 if device.type == "cpu" else 5e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens_m", [False, True])
def test_index_scores_fp8_products_round_random_queries(gpu_device, tokens_m):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 products need sm_89+")
    setting = make_setting("bf16-fp8kv")
    q, w, keys, scale, table, lens, starts, T = _index_inputs(setting, 64, 128, 64, [1, 1, 1],
                                                              [4999, 2999, 69], seed=4)
    out = index_scores(q, w, keys, table, lens, starts, 128 ** -0.5, T, index_scale=scale,
                       config={"fp8_dot": True, "tokens_m": tokens_m})
    ref = index_scores_ref(_e4m3_query(q.float()), w, keys, table, lens, starts, 128 ** -0.5, T,
                           index_scale=scale)
    finite = torch.isfinite(ref)
    err = (out[finite] - ref[finite]).abs().max() / ref[finite].abs().max()
    # the kernel's fp32 division is Triton's approximate one, so a query element on an e4m3
    # rounding boundary can round the other way (2e-4 on an H200); unrounded queries differ
    # from rounded ones by 2e-2 here
    assert err < 1e-3, err


@pytest.mark.gpu
@pytest.mark.parametrize("per_sm", [1, 4])
def test_index_scores_gluon_decode(gpu_device, per_sm):
    """Decode rows over e4m3 keys on Hopper take the Gluon kernel: its scores and group maxima
    match the reference's (queries rounded to e4m3 as it rounds them) and the Triton kernel's;
    histories off tile boundaries, a request without rows, columns past every history, chunks
    of a few tiles and of many."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon indexer is Hopper's (sm_90)")
    from splash.kernels_triton import dsa_index_gluon
    setting = make_setting("bf16-fp8kv")
    rows, prefix = [1, 1, 0, 1, 1], [4999, 2999, 7, 69, 130 * 64 - 1]
    q, w, keys, scale, table, lens, starts, T = _index_inputs(setting, 64, 128, 64, rows, prefix,
                                                              seed=5)
    cfg = {"gluon_programs_per_sm": per_sm}
    assert dsa_index_gluon.usable(q, keys, scale, 1, 8, index_config(gpu_device, cfg))
    gmax = torch.empty(q.shape[0], -(-T // 8), device=gpu_device)
    out = index_scores(q, w, keys, table, lens, starts, 128 ** -0.5, T, index_scale=scale,
                       config=cfg, max_rows=1, group_max=gmax)
    ref = index_scores_ref(_e4m3_query(q.float()), w, keys, table, lens, starts, 128 ** -0.5, T,
                           index_scale=scale)
    assert torch.equal(torch.isneginf(out), torch.isneginf(ref))
    finite = torch.isfinite(ref)
    scale_ref = ref[finite].abs().max()
    assert (out[finite] - ref[finite]).abs().max() / scale_ref < 1e-3
    ref_max = torch.nn.functional.pad(ref, (0, gmax.shape[1] * 8 - T), value=float("-inf"))
    ref_max = ref_max.view(q.shape[0], -1, 8).amax(dim=2)
    assert torch.equal(torch.isneginf(gmax), torch.isneginf(ref_max))
    seen = torch.isfinite(ref_max)
    assert (gmax[seen] - ref_max[seen]).abs().max() / scale_ref < 1e-3
    triton_out = index_scores(q, w, keys, table, lens, starts, 128 ** -0.5, T, index_scale=scale,
                              config={"gluon": False}, max_rows=1)
    assert (out[finite] - triton_out[finite]).abs().max() / scale_ref < 1e-3


def _same_sets(index, ref_index):
    for row, ref_row in zip(index.cpu().tolist(), ref_index.cpu().tolist()):
        assert sorted(row) == sorted(ref_row)


@pytest.mark.parametrize("secant", [False, True])
@pytest.mark.parametrize("parts", [1, 4])
@pytest.mark.parametrize("rows", [1, 32])
@pytest.mark.parametrize("chunk", [16, 64])
def test_topk_matches_torch(device, chunk, rows, parts, secant):
    """Rows longer than a chunk (several passes), rows with fewer finite entries than k, a row
    with none; one row a program (a GPU's) and several (the interpreter's); the winners placed
    in one column part or in several, a program a part; the k-th largest by bisection or by
    false position."""
    gen = torch.Generator().manual_seed(3)
    # 130 columns: chunks of 64 take three passes (first, middle, last); chunks of 16 take four
    # over 66 columns, launching the very kernel variants (constexprs, argument classes: a
    # partial last chunk) that five passes over 130 did, in half the interpreter's time
    values = torch.randn(4, 130 if chunk == 64 else 66, generator=gen)
    values[1, 20:] = float("-inf")  # 20 finite: all of them, then -1
    values[2] = float("-inf")
    values[3, ::2] = float("-inf")
    values = values.to(device)
    k = 8 if chunk == 16 else 24
    v, i = topk_rows(values, k, config={"CHUNK": chunk, "ROWS": rows, "PARTS": parts,
                                        "SECANT": secant})
    ref_v, ref_i = topk_rows_ref(values, k)
    assert v.shape == i.shape == (4, k) and i.dtype == torch.int32
    _same_sets(i, ref_i)
    torch.testing.assert_close(v.sort(dim=1, descending=True).values.cpu(), ref_v.cpu())


@pytest.mark.parametrize("config", [{"CHUNK": 16}, {"CHUNK": 16, "ROWS": 1},
                                    {"CHUNK": 16, "ROWS": 1, "PARTS": 4},
                                    {"CHUNK": 16, "SECANT": False},
                                    {"CHUNK": 16, "ROWS": 1, "PARTS": 2, "place_warps": 2}])
def test_topk_ties_in_column_order(device, config):
    """(SECANT is on by default: the first case is the false-position search, the fourth the
    bisection.) 50 columns in chunks of 16 (the last one partial): three passes, ties across
    chunk edges (the launches, kernel variants and passes of 120 columns)."""
    values = torch.zeros(3, 50, device=device)
    values[1, 40:] = 1.0
    values[2, 25:] = 2.0
    values[2, 10] = 3.0
    _, i = topk_rows(values, 5, config=config)
    assert sorted(i[0].tolist()) == [0, 1, 2, 3, 4]
    assert sorted(i[1].tolist()) == [40, 41, 42, 43, 44]
    assert sorted(i[2].tolist()) == [10, 25, 26, 27, 28]


def test_topk_over_wide_chunks(device):
    """k large enough that a chunk exceeds 16,384 entries, where the winners' two counts no
    longer share one int32 scan."""
    gen = torch.Generator().manual_seed(5)
    values = torch.randn(2, 40000, generator=gen)
    values[1, ::3] = 1.0  # ~4,200 entries above, then 13,334 ties at the threshold
    k = 9000  # chunk next_pow2(2k) = 32768
    v, i = topk_rows(values.to(device), k)
    ref_v, ref_i = topk_rows_ref(values, k)
    torch.testing.assert_close(v.sort(dim=1, descending=True).values.cpu(), ref_v)
    assert i[0].sort().values.cpu().tolist() == ref_i[0].sort().values.tolist()
    above = (values[1] > 1.0).nonzero().flatten()
    ties = (values[1] == 1.0).nonzero().flatten()[: k - len(above)]  # in column order
    assert i[1].sort().values.cpu().tolist() == torch.cat((above, ties)).sort().values.tolist()


@pytest.mark.parametrize("config", [None, {"CHUNK": 16, "PARTS": 4}])
def test_topk_carries_index_and_slots(device, config):
    """A given index travels with its values (-1 entries stay -1 when chosen); block tables
    turn positions into slots (with a request per row)."""
    gen = torch.Generator().manual_seed(4)
    values = torch.randn(3, 40, generator=gen).to(device)
    index = torch.randint(0, 1000, (3, 40), generator=gen, dtype=torch.int32).to(device)
    index[:, ::3] = -1
    v, i = topk_rows(values, 6, index=index, config=config)
    _same_sets(i, topk_rows_ref(values, 6, index=index)[1])
    table = block_table([40, 33], 4, 30, device, gen)
    row_req = torch.tensor([1, 0, 1], dtype=torch.int32, device=device)
    values[0, 33:] = float("-inf")  # request 1 has 33 tokens
    values[2, 33:] = float("-inf")
    _, slots = topk_rows(values, 6, block_table=table, row_req=row_req, page_size=4,
                         config=config)
    _same_sets(slots, topk_rows_ref(values, 6, block_table=table, row_req=row_req,
                                    page_size=4)[1])


def test_bad_arguments_are_clear_errors(device):
    q = torch.zeros(2, 4, 48, device=device)
    kv = torch.zeros(3, 4, 48, device=device)
    with pytest.raises(ValueError, match="slots has entries outside"):
        mla_sparse(q, kv, torch.tensor([[0, 12], [1, -1]], device=device), 0.1, 32)
    with pytest.raises(ValueError, match="one slot list per query row"):
        mla_sparse(q, kv, torch.zeros(3, 2, dtype=torch.int32, device=device), 0.1, 32)
    with pytest.raises(ValueError, match="k=0"):
        topk_rows(torch.zeros(2, 5, device=device), 0)
    with pytest.raises(ValueError, match="row_req needs a block_table"):
        topk_rows(torch.zeros(2, 5, device=device), 2,
                  row_req=torch.zeros(2, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="unknown keys \\['RADIX_BITS'\\]"):
        topk_rows(torch.zeros(2, 5, device=device), 2, config={"RADIX_BITS": 4})
    keys = torch.zeros(3, 4, 16, device=device)
    one = torch.ones(1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="weights has shape"):
        index_scores(torch.zeros(1, 2, 16, device=device), torch.zeros(1, 3, device=device),
                     keys, one[None], one, torch.tensor([0, 1], dtype=torch.int32,
                                                        device=device), 0.1, 8)
    with pytest.raises(ValueError, match="max_len"):
        index_scores(torch.zeros(1, 2, 16, device=device), torch.zeros(1, 2, device=device),
                     keys, one[None], one * 9, torch.tensor([0, 1], dtype=torch.int32,
                                                            device=device), 0.1, 8)
    with pytest.raises(ValueError, match="unknown keys \\['gluon_warps'\\]"):
        index_scores(torch.zeros(1, 2, 16, device=device), torch.zeros(1, 2, device=device),
                     keys, one[None], one, torch.tensor([0, 1], dtype=torch.int32,
                                                        device=device), 0.1, 8,
                     config={"gluon_warps": 8})


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_dsa_deepseek_shapes(gpu_device, kind):
    """V3.2 / GLM-5 shapes on the GPU: 64 index heads of 128 over fp8 (or bf16) keys, page 64,
    index_topk 2048 of 5000 tokens, then sparse MLA (L=512, R=64, 128 heads) over the winners."""
    gen = torch.Generator().manual_seed(6)
    setting = make_setting("bf16-fp8kv" if kind == "fp8" else "bf16")
    lens, PS = [5000, 3000, 70], 64
    q, w, keys, kscale, table, seq_lens, starts, T = _index_inputs(setting, 64, 128, PS,
                                                                   [1, 1, 1], [n - 1 for n in lens])
    out = index_scores(q, w, keys, table, seq_lens, starts, 128 ** -0.5, T, index_scale=kscale)
    ref = index_scores_ref(_kernel_query(q, keys), w, keys, table, seq_lens, starts, 128 ** -0.5,
                           T, index_scale=kscale)
    finite = torch.isfinite(ref)
    err = (out[finite] - ref[finite]).abs().max() / ref[finite].abs().max()
    assert err < 1e-2, err
    _, slots = topk_rows(ref.to(gpu_device), 2048, block_table=table, page_size=PS)
    _same_sets(slots, topk_rows_ref(ref.to(gpu_device), 2048, block_table=table, page_size=PS)[1])
    kv, scale = paged_cache(int(table.max()) + 1, PS, 576, setting.kv_dtype, gpu_device, gen)
    qs = torch.randn(3, 128, 576, generator=gen).to(torch.bfloat16).to(gpu_device)
    o, lse = mla_sparse(qs, kv, slots, 0.1147, 512, kv_scale=scale)
    # (at 128 heads over e4m3 KV the Gluon kernels read q in e4m3)
    ref_o, ref_lse = mla_sparse_ref(sparse_query_as_read(qs, kv, slots, 512), kv, slots, 0.1147,
                                    512, kv_scale=scale)
    assert_close(o, ref_o, setting.atol, setting.rtol)
    assert_lse(lse, ref_lse, setting.lse_tol)


def test_long_prefill_picks_in_pieces_the_same(device):
    """The layouts score a long prefill in row pieces (bounded score memory), cutting requests
    where needed; the picks equal one whole-batch pick."""
    setting = make_setting("fp32")
    rows, prefix = [6, 1, 9], [0, 21, 17]
    q, w, keys, _, table, lens, starts, _ = _index_inputs(setting, 5, 24, 4, rows, prefix, 7)
    row_req = torch.repeat_interleave(torch.arange(3), torch.tensor(rows)).to(torch.int32)
    args = {"block_table": table, "seq_lens": lens, "q_start_loc": starts,
            "row_req": row_req.to(device)}
    host = (rows, [n + p for n, p in zip(rows, prefix)])
    whole = topk_indexed(q, w, keys, None, args, 0.2, 6, {}, host)
    width = table.shape[1] * 4
    pieces = topk_indexed(q, w, keys, None, args, 0.2, 6, {}, host, budget=4 * width)
    _same_sets(pieces[1], whole[1])
    torch.testing.assert_close(pieces[0].sort(dim=1).values, whole[0].sort(dim=1).values)


@pytest.mark.parametrize("kind", ["wide", "tied", "huge"])
def test_topk_false_position_on_hard_rows(device, kind):
    """The false-position search on rows that defeat interpolation: values over many orders
    of magnitude, a few distinct values (the count jumps past k), values near the fp32 limit
    (the interpolation overflows): exact, like the bisection."""
    gen = torch.Generator().manual_seed(7)
    values = torch.randn(3, 128, generator=gen)  # chunks of 32: three passes
    if kind == "wide":
        values = values.sign() * torch.exp(values * 20)
    elif kind == "tied":
        values = (values * 1.5).round()
    else:
        values = values.sign() * 3e38
        values[1, :3] = 1.0
    values = values.to(device)
    ref_v, _ = topk_rows_ref(values, 9)
    for secant in (False, True):
        v, _ = topk_rows(values, 9, config={"CHUNK": 32, "SECANT": secant})
        torch.testing.assert_close(v.sort(dim=1, descending=True).values.cpu(), ref_v.cpu())


def test_rocm_indexer_keeps_what_was_measured_there(monkeypatch):
    """The indexer's CUDA-measured choices (fp16 / e4m3 products, gathered page ids on three
    stages) stay off under ROCm; a config still sets them."""
    monkeypatch.setattr(torch.version, "hip", "6.0", raising=False)
    gpu = torch.device("cuda")  # configs only: nothing launches
    cfg = index_config(gpu, None)
    assert (cfg["fp8_fp16"], cfg["fp8_dot"], cfg["gather_pages"], cfg["num_stages"],
            cfg["num_warps_extend"]) == (False, False, False, 2, 4)
    assert index_config(gpu, {"gather_pages": True})["gather_pages"] is True
