"""Torch references of ``mla_decode``: fp64 math, one request at a time, over the paged rows
as the cache holds them (dequantised by their scales when fp8)."""

from __future__ import annotations

import torch


def paged_rows_ref(
    kv_cache: torch.Tensor, kv_scale: torch.Tensor | None, pages: torch.Tensor, length: int
) -> torch.Tensor:
    """The first ``length`` latent rows of one request, dequantised, in fp64: (length, D)."""
    PS = kv_cache.shape[1]
    num_pages = -(-length // PS)
    idx = pages[:num_pages].long()
    rows = kv_cache[idx].double()  # (num_pages, PS, D)
    if kv_scale is not None:
        rows = rows * kv_scale[idx].double()[..., None]
    return rows.reshape(-1, kv_cache.shape[2])[:length]


def mla_decode_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    kv_lora_rank: int,
    kv_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of ``mla_decode`` (fp64 math, one request at a time)."""
    N, H, _ = q.shape
    L = kv_lora_rank
    out = torch.zeros((N, H, L), dtype=torch.float64, device=q.device)
    lse = torch.full((N, H), float("-inf"), dtype=torch.float64, device=q.device)
    for n in range(N):
        length = int(seq_lens[n])
        if length == 0:
            continue
        rows = paged_rows_ref(kv_cache, kv_scale, block_table[n], length)  # (len, D)
        scores = (q[n].double() @ rows.T) * sm_scale  # (H, len)
        lse[n] = torch.logsumexp(scores, dim=-1)
        out[n] = torch.softmax(scores, dim=-1) @ rows[:, :L]  # (H, L)
    return out.to(q.dtype), lse.float()
