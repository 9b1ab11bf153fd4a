"""mla_decode's dimension-chunked kernel (``config["dim_chunks"]``) against the fp64 torch
reference: both split schemes, masked chunks, page ids loaded per tile or gathered from blocks,
fp8 KV with fp16 products (q cast once)."""

from __future__ import annotations

import pytest
import torch
from kernel_data import assert_close, assert_lse, decode_inputs, make_setting

from splash.kernels_triton import mla_decode, mla_decode_ref

# (L, R, page size, heads, lengths): L = 48 leaves the last 16-column chunk of 64 masked; L =
# 64 fills all four; ragged lengths with 0 and 1, tail tiles, heads past the head group
CASES = {
    "masked-chunk": (48, 16, 16, 20, [0, 1, 35, 77]),
    "full-chunks": (64, 16, 64, 16, [130, 64]),
}


@pytest.mark.parametrize(("chunks", "gather"), [(True, False), (True, True), (True, 2),
                                               (False, True), (False, 2)])
@pytest.mark.parametrize("splits", ["balanced", 1, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_chunked_matches_reference(setting, case, splits, chunks, gather):
    """... and, in both heads-on-M kernels, with the page ids gathered from blocks loaded once
    (``gather_pages``: True, the launcher's blocks; 2, two-page blocks: a split crosses many)."""
    L, R, PS, H, lens = CASES[case]
    q, kv, scale, table, seq_lens = decode_inputs(setting, L, R, PS, H, lens, seed=6)
    cfg = {"dim_chunks": chunks, "balanced": splits == "balanced", "min_split_tokens": 16,
           "gather_pages": gather, **({"BLOCK_N": 16} if gather == 2 else {})}
    num_splits = None if splits == "balanced" else splits
    out, lse = mla_decode(q, kv, table, seq_lens, 0.15, L, kv_scale=scale, num_splits=num_splits,
                          config=cfg)
    ref_out, ref_lse = mla_decode_ref(q, kv, table, seq_lens, 0.15, L, kv_scale=scale)
    assert out.dtype == q.dtype and out.shape == (len(lens), H, L)
    assert_close(out, ref_out, setting.atol, setting.rtol)
    assert_lse(lse, ref_lse, setting.lse_tol)


def test_chunked_fp16_products_saturate_like_the_head_group_kernel(device):
    """fp8 KV with fp16 products: the launcher's one cast of q clamps to fp16's range exactly as
    the head-group kernel's in-kernel cast does, so both forms give the same result."""
    setting = make_setting("fp16-fp8kv")
    L, R, PS, H, lens = CASES["full-chunks"]
    q, kv, scale, table, seq_lens = decode_inputs(setting, L, R, PS, H, lens, seed=7)
    q = q.float()
    q[0, 0, :4] = 1e6  # beyond fp16's range: saturates at 65504 in both
    base = {"fp8_fp16": True, "balanced": False}
    ref = mla_decode(q, kv, table, seq_lens, 1e-6, L, kv_scale=scale, num_splits=2, config=base)
    got = mla_decode(q, kv, table, seq_lens, 1e-6, L, kv_scale=scale, num_splits=2,
                     config={**base, "dim_chunks": True})
    torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], ref[1], atol=1e-5, rtol=1e-5)


def test_gather_pages_must_hold_a_tile(device):
    q = torch.zeros(1, 16, 80, device=device)
    kv = torch.zeros(4, 16, 80, device=device)
    one = torch.ones(1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="gather_pages=3"):
        mla_decode(q, kv, one[:, None] * 0, one, 0.1, 64,
                   config={"dim_chunks": True, "gather_pages": 3, "BLOCK_N": 16})


def test_chunks_yield_where_they_do_not_apply(setting):
    """Latents under 64 columns (chunks of under 16) take the unchunked kernel: same results as
    without chunks."""
    q, kv, scale, table, seq_lens = decode_inputs(setting, 32, 16, 16, 16, [9, 40], seed=8)
    base = {"balanced": False}
    want = mla_decode(q, kv, table, seq_lens, 0.15, 32, kv_scale=scale, num_splits=2, config=base)
    got = mla_decode(q, kv, table, seq_lens, 0.15, 32, kv_scale=scale, num_splits=2,
                     config={**base, "dim_chunks": True})
    torch.testing.assert_close(got[0], want[0], atol=0, rtol=0)
    torch.testing.assert_close(got[1], want[1], atol=0, rtol=0)
