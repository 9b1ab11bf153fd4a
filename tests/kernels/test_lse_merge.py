"""lse_merge against its reference, and against attention over the union of the key sets."""

from __future__ import annotations

import pytest
import torch
from kernel_data import assert_close, assert_lse, block_table, paged_cache

from splash.kernels_triton import lse_merge, lse_merge_ref, mla_decode, mla_decode_ref


# 19 partials: two rounds of the many-partials fold, the second part past the last partial;
# 40 over 200 columns: three rounds on a row wider than any earlier case
@pytest.mark.parametrize("num_parts, L", [(1, 24), (3, 24), (19, 24), (40, 200)])
def test_merge_matches_reference(setting, num_parts, L):
    gen = torch.Generator().manual_seed(0)
    S, N, H = num_parts, 3, 5
    outs = torch.randn(S, N, H, L, generator=gen).to(setting.q_dtype)
    lses = torch.randn(S, N, H, generator=gen) * 3
    lses[0, 0, 0] = float("-inf")  # one empty partial
    lses[:, 1, 2] = float("-inf")  # every partial empty: out 0, lse -inf
    outs[0, 0, 0] = float("nan")  # an empty partial's output is never read into the sum
    if S > 9:  # and one deep in a long run of partials, beside the row's largest lse
        lses[9, 2, 1], outs[9, 2, 1] = float("-inf"), float("nan")
        lses[10, 2, 1] = 20.0
    outs, lses = outs.to(setting.device), lses.to(setting.device)
    out, lse = lse_merge(outs, lses)
    ref_out, ref_lse = lse_merge_ref(outs, lses)
    assert out.dtype == outs.dtype and out.shape == (N, H, L)
    assert_close(out, ref_out, setting.atol, setting.rtol)
    assert_lse(lse, ref_lse, setting.lse_tol)
    assert torch.all(out[1, 2].cpu() == 0) and torch.isneginf(lse[1, 2]).item()


def test_merge_of_key_halves_is_attention_over_all_keys(device):
    """Two decode passes over disjoint page sets (as CP ranks hold them) merge exactly."""
    gen = torch.Generator().manual_seed(1)
    L, R, PS, H = 32, 16, 16, 4
    lens = [40, 17]
    kv, _ = paged_cache(8, PS, L + R, torch.float32, device, gen)
    table = block_table(lens, PS, 8, device, gen)
    q = torch.randn(2, H, L + R, generator=gen).to(device)
    full, full_lse = mla_decode_ref(q, kv, table, torch.tensor(lens), 0.2, L)
    # part A: the first page of each request; part B: the rest, as its own short table
    lens_a = torch.tensor([min(n, PS) for n in lens], dtype=torch.int32, device=device)
    lens_b = torch.tensor([max(n - PS, 0) for n in lens], dtype=torch.int32, device=device)
    table_b = torch.cat([table[:, 1:], table[:, :1]], dim=1)
    o_a, l_a = mla_decode(q, kv, table, lens_a, 0.2, L, num_splits=1)
    o_b, l_b = mla_decode(q, kv, table_b, lens_b, 0.2, L, num_splits=1)
    out, lse = lse_merge(torch.stack([o_a, o_b]), torch.stack([l_a, l_b]))
    assert_close(out, full, 1e-5, 1e-5)
    assert_lse(lse, full_lse, 1e-5)


@pytest.mark.parametrize(
    "outs, lses, message",
    [
        (torch.zeros(2, 3, 4), torch.zeros(2, 3), "outs must have 4 dims"),
        (torch.zeros(2, 3, 4, 5), torch.zeros(2, 3, 5), "lses has shape"),
        (torch.zeros(2, 3, 4, 5), torch.zeros(2, 3, 4, dtype=torch.float16), "lses has dtype"),
        (torch.zeros(2, 3, 4, 5, dtype=torch.int32), torch.zeros(2, 3, 4), "outs has dtype"),
        (torch.zeros(0, 3, 4, 5), torch.zeros(0, 3, 4), "S >= 1"),
    ],
)
def test_merge_rejects_bad_input(outs, lses, message):
    with pytest.raises(ValueError, match=message):
        lse_merge(outs, lses)
