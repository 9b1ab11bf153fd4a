"""RMSNorm in one kernel, optionally fused with the residual add before it.

A decode step normalises every layer's input and attention output, and the latent projections
inside MLA: in torch each norm is half a dozen tiny kernels (cast, square, mean, rsqrt, scale,
cast, weight), and the residual add one more. At decode batch sizes each is a few
microseconds of launch and almost no bytes, so together they cost the step more than their
data does. One program here normalises one row.

Numerics follow DeepSeek/HF exactly: ``h = x + residual`` rounded to x's dtype (what torch's
add stores), then ``weight * (h_f32 * rsqrt(mean(h_f32^2) + eps)).to(h.dtype)``, the product in
the promoted dtype of weight and h.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splash.kernels_triton import _validate as V


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # (M, D)
    res_ptr,  # (M, D) added to x first (HAS_RES)
    w_ptr,  # (D,)
    y_ptr,  # (M, D) normalised
    sum_ptr,  # (M, D) x + res (HAS_RES)
    D,
    stride_x, stride_r, stride_y, stride_s,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / D
    xn = (xf * (1.0 / tl.sqrt(var + eps))).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    y = w.to(tl.float32) * xn.to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
            out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    V.check_tensor("x", x, x.dim(), V.FLOAT_DTYPES)
    if x.dim() < 1:
        raise ValueError("x must have at least one dim")
    d = x.shape[-1]
    V.check_tensor("weight", weight, 1, V.FLOAT_DTYPES, x.device)
    V.check_dim("weight", weight, 0, d, "x's last dim")
    rows = x.reshape(-1, d)
    if rows.numel() and rows.stride(-1) != 1:
        rows = rows.contiguous()
    res = None
    if residual is not None:
        V.check_tensor("residual", residual, x.dim(), (x.dtype,), x.device)
        if residual.shape != x.shape:
            raise ValueError(f"residual has shape {tuple(residual.shape)}; expected "
                             f"{tuple(x.shape)} (x's)")
        res = residual.reshape(-1, d)
        if res.numel() and res.stride(-1) != 1:
            res = res.contiguous()
    dtype = torch.promote_types(x.dtype, weight.dtype)
    if out is None:
        y = torch.empty(rows.shape, dtype=dtype, device=x.device)
    else:  # a view to write into, e.g. a slice of a wider row (rows must stay a view)
        V.check_tensor("out", out, x.dim(), (dtype,), x.device)
        if out.shape != x.shape or (out.numel() and out.stride(-1) != 1):
            raise ValueError(f"out must have x's shape {tuple(x.shape)} and unit last stride")
        y = out.reshape(-1, d)
        if y.numel() and y.data_ptr() != out.data_ptr():
            raise ValueError("out's rows must be addressable as one strided matrix")
    total = torch.empty_like(rows) if res is not None else None
    m = rows.shape[0]
    if m:
        block = V.next_pow2(d)
        _rms_norm_kernel[(m,)](
            rows, res if res is not None else rows, weight, y,
            total if total is not None else y, d,
            rows.stride(0), res.stride(0) if res is not None else 0, y.stride(0),
            total.stride(0) if total is not None else 0, float(eps),
            HAS_RES=res is not None, BLOCK=block, num_warps=8 if block >= 4096 else 4)
    y = out if out is not None else y.view(x.shape)
    return y, total.view(x.shape) if total is not None else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., D), weight (D,) -> (..., D) normalised (see the module docstring), written into
    ``out`` when given (x's shape, unit last stride: e.g. the first D columns of wider rows)."""
    return _launch(x, weight, eps, None, out)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, rms_norm(x + residual)) in one pass; x, residual (..., D), same dtype."""
    y, total = _launch(x, weight, eps, residual)
    assert total is not None
    return total, y


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Torch reference: HF's DeepseekV3RMSNorm."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + residual
    return total, rms_norm_ref(total, weight, eps)
