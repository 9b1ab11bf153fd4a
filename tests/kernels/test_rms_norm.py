"""rms_norm / add_rms_norm against HF's RMSNorm (torch reference), in every test dtype."""

from __future__ import annotations

import pytest
import torch
from kernel_data import assert_close

from splash.kernels_triton import add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_ref


@pytest.mark.parametrize("d", [64, 100, 512])
def test_rms_norm_matches_reference(setting, d):
    gen = torch.Generator().manual_seed(d)
    x = (torch.randn(5, d, generator=gen) * 3).to(setting.q_dtype).to(setting.device)
    w = (torch.rand(d, generator=gen) + 0.5).to(setting.q_dtype).to(setting.device)
    y = rms_norm(x, w, 1e-6)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_close(y, rms_norm_ref(x, w, 1e-6), setting.atol, setting.rtol)


def test_add_rms_norm_matches_reference(setting):
    gen = torch.Generator().manual_seed(0)
    d = 96
    x = torch.randn(2, 3, d, generator=gen).to(setting.q_dtype).to(setting.device)
    r = torch.randn(2, 3, d, generator=gen).to(setting.q_dtype).to(setting.device)
    w = torch.randn(d, generator=gen).to(setting.q_dtype).to(setting.device)
    total, y = add_rms_norm(x, r, w, 1e-5)
    ref_total, ref_y = add_rms_norm_ref(x, r, w, 1e-5)
    assert torch.equal(total.cpu(), ref_total.cpu())  # the add rounds as torch's does
    assert_close(y, ref_y, setting.atol, setting.rtol)


def test_strided_rows_and_promoted_weight(device):
    """A column slice (the latent part of a projection, as MLA normalises it) and an fp32
    weight on fp16 rows (the output takes the promoted dtype, as in torch)."""
    gen = torch.Generator().manual_seed(1)
    full = torch.randn(4, 40, generator=gen).to(device)
    x = full[:, :32]
    w = torch.rand(32, generator=gen).to(device)
    assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), 1e-5, 1e-5)
    h = x.to(torch.float16)
    y = rms_norm(h, w, 1e-6)
    assert y.dtype == torch.float32
    assert_close(y, rms_norm_ref(h, w, 1e-6), 5e-3, 5e-3)
    assert rms_norm(full[:0, :32], w, 1e-6).shape == (0, 32)


def test_bad_arguments_raise_clear_errors(device):
    x = torch.randn(3, 8, device=device)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(7, device=device), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(x, torch.ones(3, 7, device=device), torch.ones(8, device=device), 1e-6)
    with pytest.raises(ValueError, match="dtype"):
        rms_norm(x.to(torch.int32), torch.ones(8, device=device), 1e-6)


def test_rms_norm_writes_into_the_first_columns_of_wider_rows(device):
    """``out``: the normalised rows land in a column slice of a wider buffer (MLA's latent
    row: normalised c_kv then the roped key); the other columns are left as they were."""
    gen = torch.Generator().manual_seed(4)
    kv = torch.randn(5, 40, generator=gen).to(device)
    w = torch.rand(32, generator=gen).to(device)
    buf = torch.full((5, 40), 7.0, device=device)
    got = rms_norm(kv[:, :32], w, 1e-6, out=buf[:, :32])
    assert got.data_ptr() == buf.data_ptr()
    assert_close(buf[:, :32], rms_norm_ref(kv[:, :32], w, 1e-6), 1e-5, 1e-5)
    assert torch.all(buf[:, 32:].cpu() == 7.0)
    with pytest.raises(ValueError, match="out"):
        rms_norm(kv[:, :32], w, 1e-6, out=buf[:, :16])
