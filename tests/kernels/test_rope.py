"""rope against its torch reference (the model's rotary embedding arithmetic)."""

from __future__ import annotations

import pytest
import torch
from kernel_data import assert_close

from splash.kernels_triton import rope, rope_ref


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("heads", [1, 5, 20])
def test_rope_matches_reference(setting, interleave, heads):
    gen = torch.Generator().manual_seed(heads)
    r = 16
    x = torch.randn(3, heads, r, generator=gen).to(setting.q_dtype).to(setting.device)
    pos = torch.tensor([0, 7, 300], device=setting.device)
    inv = (1.0 / 10000 ** (torch.arange(0, r, 2) / r)).float().to(setting.device)
    got = rope(x, pos, inv, 0.9, interleave)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert_close(got, rope_ref(x, pos, inv, 0.9, interleave), setting.atol, setting.rtol)


def test_rope_of_column_slices(device):
    """The slices MLA rotates: the rope columns of a projection, rows (N, R) and heads."""
    gen = torch.Generator().manual_seed(2)
    inv = (1.0 / 10000 ** (torch.arange(0, 8, 2) / 8)).float().to(device)
    pos = torch.arange(4, device=device) * 3
    kv = torch.randn(4, 40, generator=gen).to(device)
    assert_close(rope(kv[:, 32:], pos, inv, 1.0, True), rope_ref(kv[:, 32:], pos, inv, 1.0, True),
                 1e-5, 1e-5)
    q = torch.randn(4, 3, 24, generator=gen).to(device)
    assert_close(rope(q[..., 16:], pos, inv, 1.0, False),
                 rope_ref(q[..., 16:], pos, inv, 1.0, False), 1e-5, 1e-5)


def test_bad_arguments_raise_clear_errors(device):
    x = torch.randn(2, 8, device=device)
    inv = torch.ones(4, device=device)
    with pytest.raises(ValueError, match="positions"):
        rope(x, torch.zeros(3, dtype=torch.long, device=device), inv, 1.0, True)
    with pytest.raises(ValueError, match="inv_freq"):
        rope(x, torch.zeros(2, dtype=torch.long, device=device), torch.ones(3, device=device),
             1.0, True)


def test_rope_writes_into_the_rope_columns_of_wider_rows(device):
    """``out``: the roped part lands in the last R columns of each (row, head) of a wider
    buffer (MLA's query and latent rows); the other columns are left as they were."""
    gen = torch.Generator().manual_seed(3)
    inv = (1.0 / 10000 ** (torch.arange(0, 8, 2) / 8)).float().to(device)
    pos = torch.arange(4, device=device) * 5
    q = torch.randn(4, 3, 24, generator=gen).to(device)
    buf = torch.full((4, 3, 40), 7.0, device=device)
    got = rope(q[..., 16:], pos, inv, 0.8, False, out=buf[..., 32:])
    assert got.data_ptr() == buf[..., 32:].data_ptr()
    assert_close(buf[..., 32:], rope_ref(q[..., 16:], pos, inv, 0.8, False), 1e-5, 1e-5)
    assert torch.all(buf[..., :32].cpu() == 7.0)
    with pytest.raises(ValueError, match="shape"):
        rope(q[..., 16:], pos, inv, 0.8, False, out=buf[..., 30:])
