"""Rotary position embedding in one kernel.

MLA rotates the rope part of every query head and of the latent key once per layer. In torch
that is some fifteen tiny kernels (angles, cos, sin, scaling, the pair arithmetic, stacking,
casts); here one program rotates ``BLOCK_H`` heads of one row.

Numerics follow the torch reference (`splash.model.rope.RotaryEmbedding`): angles
``position * inv_freq`` and the rotation in fp32, cos and sin scaled (YaRN) before use, the
result rounded to the output dtype. Pairs are ``(x[2i], x[2i+1])`` when interleaved, else
``(x[i], x[i + R/2])``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splash.kernels_triton import _validate as V


@triton.jit
def _rope_kernel(
    x_ptr,  # (N, H, R)
    pos_ptr,  # (N,)
    freq_ptr,  # (R/2,) fp32
    out_ptr,  # (N, H, R)
    H,
    stride_xn, stride_xh, stride_xr,
    stride_on, stride_oh, stride_or,
    scale,
    HALF: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_i = tl.arange(0, BLOCK_I)
    mask_i = offs_i < HALF
    mask = (offs_h < H)[:, None] & mask_i[None, :]
    angle = tl.load(pos_ptr + n).to(tl.float32) * tl.load(freq_ptr + offs_i, mask=mask_i,
                                                          other=0.0)
    cos = (tl.cos(angle) * scale)[None, :]
    sin = (tl.sin(angle) * scale)[None, :]
    if INTERLEAVE:
        i1 = 2 * offs_i
        i2 = 2 * offs_i + 1
    else:
        i1 = offs_i
        i2 = offs_i + HALF
    xb = x_ptr + n * stride_xn + offs_h[:, None] * stride_xh
    x1 = tl.load(xb + i1[None, :] * stride_xr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xb + i2[None, :] * stride_xr, mask=mask, other=0.0).to(tl.float32)
    ob = out_ptr + n * stride_on + offs_h[:, None] * stride_oh
    dt = out_ptr.dtype.element_ty
    tl.store(ob + i1[None, :] * stride_or, (x1 * cos - x2 * sin).to(dt), mask=mask)
    tl.store(ob + i2[None, :] * stride_or, (x2 * cos + x1 * sin).to(dt), mask=mask)


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scale: float,
         interleave: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """x (N, ..., R) rotated by ``positions`` (N,) -> a new tensor of x's shape and dtype, or
    ``out`` (x's shape, any strides and float dtype: e.g. the rope columns of wider rows)
    written in place."""
    V.check_tensor("x", x, x.dim(), V.FLOAT_DTYPES)
    if x.dim() < 2:
        raise ValueError(f"x must be (N, ..., R), got shape {tuple(x.shape)}")
    n, r = x.shape[0], x.shape[-1]
    V.check_tensor("positions", positions, 1, V.INDEX_DTYPES, x.device)
    V.check_dim("positions", positions, 0, n, "x's rows")
    V.check_tensor("inv_freq", inv_freq, 1, (torch.float32,), x.device)
    if r % 2 or inv_freq.shape[0] != r // 2:
        raise ValueError(f"inv_freq has {inv_freq.shape[0]} entries; x's last dim {r} needs "
                         f"{r // 2} (an even rope dim)")
    rows = x.reshape(n, -1, r)  # a view for the slices MLA passes (no copy)
    if out is None:
        dst = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    else:
        V.check_tensor("out", out, x.dim(), V.FLOAT_DTYPES, x.device)
        if out.shape != x.shape:
            raise ValueError(f"out has shape {tuple(out.shape)}; expected {tuple(x.shape)}")
        dst = out.reshape(n, -1, r)
        if dst.numel() and dst.data_ptr() != out.data_ptr():
            raise ValueError("out must be viewable as (N, heads, R) without a copy")
    heads = rows.shape[1]
    if n and heads:
        block_h = min(V.next_pow2(heads, 1), 16)
        _rope_kernel[(n, triton.cdiv(heads, block_h))](
            rows, positions, inv_freq, dst, heads,
            rows.stride(0), rows.stride(1), rows.stride(2),
            dst.stride(0), dst.stride(1), dst.stride(2), float(scale),
            HALF=r // 2, INTERLEAVE=bool(interleave), BLOCK_H=block_h,
            BLOCK_I=V.next_pow2(r // 2, 1), num_warps=2)
    return out if out is not None else dst.view(x.shape)


def rope_ref(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scale: float,
             interleave: bool) -> torch.Tensor:
    """Torch reference (the model's RotaryEmbedding arithmetic)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos() * scale, freqs.sin() * scale
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.view(shape), sin.view(shape)
    xf = x.float()
    if interleave:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2) \
            .to(x.dtype)
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
