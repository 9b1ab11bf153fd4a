"""The non-absorbed form of a prefill chunk, for layouts where this rank holds every history row
of the requests it computes and the projections of the heads it computes: TP, DP, and CP over
the histories its prefill gathers (DOP stays absorbed: a row's owner attends for heads whose
projections other ranks hold).

Absorbed attention (``attend``) scores each (row, key) pair over L + R dims and reads L-dim
values (576 and 512 for DeepSeek-V3). Expanded, each history row is first turned into per-head
keys and values through W_UK and W_UV (once per row and head), and then every pair costs
nope + R and v dims (192 and 128): 3.4× fewer FLOPs per pair. Long prefill chunks, where pairs
outnumber rows, run faster this way; decode and short chunks stay absorbed.

``SPLASH_MHA_PREFILL=N`` turns it on for steps whose rows on this rank number at least N (off by
default until measured on a GPU); the expanded keys and values of a step must fit
``EXPANDED_BUDGET`` bytes, else the step stays absorbed. DSA layers that select positions stay
absorbed (they attend only the selected slots).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from splash import envs
from splash.errors import ConfigError
from splash.kernels_triton import kv_gather
from splash.kernels_triton.mha_extend import mha_extend
from splash.layouts.base import KVStore, StepMeta

EXPANDED_BUDGET = 1 << 30  # bytes of expanded keys and values one layer of a step may take


def min_rows() -> int:
    """The rows a step needs on this rank to run expanded (0: never)."""
    value = envs.get("SPLASH_MHA_PREFILL")
    if not value:
        return 0
    if not value.isdigit():
        raise ConfigError(f"SPLASH_MHA_PREFILL={value!r} must be a number of rows (or unset)")
    return int(value)


def use_expanded(attn: Any, meta: StepMeta, rows: int, keys: int) -> bool:
    """Whether a prefill step's ``rows`` query rows on this rank over ``keys`` history rows run
    expanded in this layer."""
    threshold = min_rows()
    if not threshold or meta.all_decode or rows < threshold:
        return False
    if attn.is_sparse and not meta.within_topk(attn.cfg.index_topk):
        return False
    c = attn.cfg
    per_key = attn.num_heads * (c.qk_nope_head_dim + c.v_head_dim) + c.qk_rope_head_dim
    return keys * per_key * attn.w_uk.element_size() <= EXPANDED_BUDGET


def use_expanded_for(attn: Any, meta: StepMeta, reqs: list[int]) -> bool:
    """`use_expanded` for this rank's rows of ``reqs``, each over its whole history (TP, DP)."""
    return bool(reqs) and use_expanded(attn, meta, sum(meta.plan.query_lens[b] for b in reqs),
                                       sum(meta.plan.context_lens[b] for b in reqs))


def history_slots(meta: StepMeta, reqs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every history slot of ``reqs`` in position order, request by request, and where each
    request's keys start (B,): what the expanded keys are gathered from."""
    ps = meta.page_size
    lens = [meta.plan.context_lens[b] for b in reqs]
    parts = []
    for b, n in zip(reqs, lens):
        pos = np.arange(n, dtype=np.int64)
        parts.append(np.asarray(meta.tables[b], dtype=np.int64)[pos // ps] * ps + pos % ps)
    slots = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int32)
    return (torch.from_numpy(slots).to(meta.device), torch.from_numpy(starts).to(meta.device))


def dequantised(got: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                dtype: torch.dtype) -> torch.Tensor:
    """Gathered latent rows (``kv_gather``'s result: rows, or fp8 rows and their scales) in
    ``dtype``."""
    if isinstance(got, tuple):
        rows, scale = got
        return (rows.float() * scale.reshape(-1)[:, None]).to(dtype)
    return got.to(dtype)


def attend_rows(attn: Any, rows: torch.Tensor, q_in: torch.Tensor, positions: torch.Tensor,
                args: dict, k_start: torch.Tensor, config: dict | None) -> torch.Tensor:
    """The expanded attention output (n, h, v) of query rows (``q_in``: their normalised q_a
    latents, ``positions``) over history ``rows`` (Nk, L + R), request b's keys at
    [k_start[b], k_start[b] + args["seq_lens"][b])."""
    L = attn.cfg.kv_lora_rank
    k_nope, v = attn.expand(rows[:, :L])
    q = attn.query_expanded(q_in, positions)
    return mha_extend(q, k_nope, rows[:, L:].to(q.dtype).contiguous(), v, args["q_start_loc"],
                      k_start, args["seq_lens"], attn.sm_scale, config=config)


def attend_expanded(store: KVStore, layer: int, attn: Any, q_in: torch.Tensor,
                    positions: torch.Tensor, meta: StepMeta, reqs: list[int],
                    args: dict) -> torch.Tensor:
    """The attention output (n, h, v) of this rank's rows of ``reqs`` over their whole
    histories (written already), in the expanded form; ``attn.output_expanded`` projects it."""
    slots, k_start = meta.cached(("expanded", tuple(reqs)), lambda: history_slots(meta, reqs))
    cache, scale = store.layer(layer)
    rows = dequantised(kv_gather(cache, slots, kv_scale=scale), attn.w_uk.dtype)
    return attend_rows(attn, rows, q_in, positions, args, k_start,
                       store.configs.get("mha_extend") or None)
