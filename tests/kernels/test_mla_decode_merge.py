"""mla_decode's split merge inside the attention kernel (``config["fused_merge"]``: the last
split of each request merges the partials) against the fp64 reference and the separate merge
launch, for both split schemes and both head-group kernels; the arrival counters end at zero."""

from __future__ import annotations

import pytest
import torch
from kernel_data import assert_close, assert_lse, decode_inputs

from splash.kernels_triton import mla_decode, mla_decode_ref
from splash.kernels_triton.lse_merge import _RETIRED, arrival_counters

# ragged lengths: an empty request, a one-token one (one split each), and long ones that split
L, R, PS, H, LENS = 64, 16, 16, 20, [0, 1, 77, 130, 35]


@pytest.mark.parametrize("chunks", [False, True])
@pytest.mark.parametrize("splits", ["balanced", 1, 3])
def test_fused_merge_matches_reference_and_launch(setting, splits, chunks):
    q, kv, scale, table, seq_lens = decode_inputs(setting, L, R, PS, H, LENS, seed=11)
    base = {"dim_chunks": chunks, "balanced": splits == "balanced", "min_split_tokens": 16}
    num_splits = None if splits == "balanced" else splits
    ref_out, ref_lse = mla_decode_ref(q, kv, table, seq_lens, 0.15, L, kv_scale=scale)
    got = {}
    for fused in (True, False, True):  # the second fused launch reuses the reset counters
        got[fused] = mla_decode(q, kv, table, seq_lens, 0.15, L, kv_scale=scale,
                                num_splits=num_splits, config={**base, "fused_merge": fused})
        assert_close(got[fused][0], ref_out, setting.atol, setting.rtol)
        assert_lse(got[fused][1], ref_lse, setting.lse_tol)
    torch.testing.assert_close(got[True][0].float(), got[False][0].float(),
                               atol=setting.atol, rtol=setting.rtol)
    counters = arrival_counters(q.device, 1)
    assert counters is not None and int(counters.abs().sum()) == 0


def test_counters_grow_and_keep_the_outgrown(device):
    small = arrival_counters(device, 10)
    big = arrival_counters(device, small.numel() + 1)
    assert big.numel() > small.numel() and int(big.abs().sum()) == 0
    assert arrival_counters(device, 10) is big
    assert any(t is small for t in _RETIRED)
