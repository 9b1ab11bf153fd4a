"""mha_extend (non-absorbed prefill over expanded keys and values) against its fp64 torch
reference, and against the absorbed kernel (mla_extend) on keys and values expanded from the same
latent rows: the two forms of MLA attention must agree."""

from __future__ import annotations

import pytest
import torch
from kernel_data import assert_close, assert_lse, make_setting

from splash.kernels_triton import mla_extend
from splash.kernels_triton.mha_extend import mha_extend, mha_extend_ref

# (heads, nope dims, rope dims, value dims, chunk rows per request, prefix per request): a
# fresh prompt, prefixes, an empty chunk, one-row chunks, chunks over several row blocks,
# dims that are not powers of two
CASES = {
    "mixed": (3, 16, 8, 16, [5, 20, 1, 0], [0, 13, 40, 7]),
    "npow2": (2, 12, 8, 10, [17, 3], [35, 0]),
    "long-chunk": (2, 16, 8, 16, [40], [70]),
}


def _inputs(H, DN, R, DV, rows, prefix, dtype, dev, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lens = [n + p for n, p in zip(rows, prefix)]
    Nk = sum(lens)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(dev)

    gap = 3  # keys of one request need not follow the last one's (CP's paged transient)
    Nk += gap * len(lens)
    q, k_nope, k_rope, v = rnd(sum(rows), H, DN + R), rnd(Nk, H, DN), rnd(Nk, R), rnd(Nk, H, DV)
    q_start = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int32,
                           device=dev)
    k_start = torch.tensor([sum(lens[:b]) + gap * (b + 1) for b in range(len(lens))],
                           dtype=torch.int32, device=dev)
    return q, k_nope, k_rope, v, q_start, k_start, torch.tensor(lens, dtype=torch.int32,
                                                                 device=dev)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", ["fp32", pytest.param("bf16", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("causal", [True, False])
def test_mha_extend_matches_reference(case, dtype, causal):
    setting = make_setting(dtype)
    H, DN, R, DV, rows, prefix = CASES[case]
    args = _inputs(H, DN, R, DV, rows, prefix, setting.q_dtype, setting.device)
    out, lse = mha_extend(*args, sm_scale=(DN + R) ** -0.5, causal=causal)
    ref, ref_lse = mha_extend_ref(*args, sm_scale=(DN + R) ** -0.5, causal=causal)
    assert out.shape == (sum(rows), H, DV) and out.dtype == setting.q_dtype
    assert_close(out, ref, setting.atol, setting.rtol)
    assert_lse(lse, ref_lse, setting.lse_tol)


@pytest.mark.parametrize("config", [{"BLOCK_M": 32, "BLOCK_N": 16}, {"BLOCK_M": 16, "BLOCK_N": 32}])
def test_mha_extend_launch_variants(config):
    setting = make_setting("fp32")
    H, DN, R, DV, rows, prefix = CASES["mixed"]
    args = _inputs(H, DN, R, DV, rows, prefix, setting.q_dtype, setting.device, seed=1)
    assert_close(mha_extend(*args, sm_scale=0.1, config=config)[0],
                 mha_extend_ref(*args, sm_scale=0.1)[0], setting.atol, setting.rtol)


def test_mha_equals_absorbed_attention_on_the_same_latent_rows():
    """q·k = (q_nope·W_UK)·c + q_rope·k_rope and p·v = (p·c)·W_UVᵀ: expanding the latent rows
    and absorbing the weights into the query give the same output."""
    setting = make_setting("fp32")
    dev, gen = setting.device, torch.Generator().manual_seed(3)
    H, DN, R, DV, L, PS = 2, 16, 8, 12, 32, 16
    rows, prefix = [6, 1], [10, 21]
    lens = [n + p for n, p in zip(rows, prefix)]
    pages = [-(-n // PS) for n in lens]
    kv = torch.randn(sum(pages), PS, L + R, generator=gen).to(dev)
    table = torch.zeros((2, max(pages)), dtype=torch.int32, device=dev)
    table[0, :pages[0]] = torch.arange(pages[0])
    table[1, :pages[1]] = pages[0] + torch.arange(pages[1])
    w_uk = torch.randn(H, DN, L, generator=gen).to(dev) * 0.2
    w_uv = torch.randn(H, DV, L, generator=gen).to(dev) * 0.2
    q = torch.randn(sum(rows), H, DN + R, generator=gen).to(dev)
    hist = torch.cat([kv[table[b, :pages[b]].long()].reshape(-1, L + R)[:lens[b]]
                      for b in range(2)])  # (Nk, L + R), request by request
    k_nope = torch.einsum("tl,hdl->thd", hist[:, :L], w_uk).contiguous()
    v = torch.einsum("tl,hdl->thd", hist[:, :L], w_uv).contiguous()
    q_start = torch.tensor([0, rows[0], sum(rows)], dtype=torch.int32, device=dev)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    out, lse = mha_extend(q, k_nope, hist[:, L:].contiguous(), v, q_start,
                          torch.tensor([0, lens[0]], dtype=torch.int32, device=dev), seq_lens,
                          0.15)
    q_abs = torch.cat([torch.einsum("nhd,hdl->nhl", q[..., :DN], w_uk), q[..., DN:]], dim=-1)
    o_lat, lse_lat = mla_extend(q_abs.contiguous(), kv, table, seq_lens, q_start, 0.15, L)
    assert_close(out, torch.einsum("nhl,hdl->nhd", o_lat, w_uv), 1e-4, 1e-4)
    assert_lse(lse, lse_lat, 1e-4)


def test_mha_extend_rejects_mismatched_shapes():
    q, k_nope, k_rope, v, qs, ks, lens = _inputs(2, 16, 8, 16, [3], [2], torch.float32,
                                                 torch.device("cpu"))
    with pytest.raises(ValueError, match="shapes disagree"):
        mha_extend(q[..., :20], k_nope, k_rope, v, qs, ks, lens, 0.1)
    with pytest.raises(ValueError, match="seq_lens"):
        mha_extend(q, k_nope, k_rope, v, qs, ks, lens[:0], 0.1)
