"""The non-absorbed form of a prefill chunk, for layouts where this rank holds every history row
of the requests it computes and the projections of the heads it computes: TP, DP, and CP over
the histories its prefill gathers (DOP stays absorbed: a row's owner attends for heads whose
projections other ranks hold).

Absorbed attention (``attend``) scores each (row, key) pair over L + R dims and reads L-dim
values (576 and 512 for DeepSeek-V3). Expanded, each history row is first turned into per-head
keys and values through W_UK and W_UV (once per row and head), and then every pair costs
nope + R and v dims (192 and 128): 3.4× fewer FLOPs per pair. Long prefill chunks, where pairs
outnumber rows, run faster this way; decode and short chunks stay absorbed.

Which form a step takes is decided from its shape, on the host, by the FLOPs each form does
(``splash.core.mla_forms``; expanded FLOPs run faster by a measured factor): absorbed pays
(2L + R) per pair and the projections of its query and output rows; expanded pays nope + R + v
per pair and the expansion of every history row. A decode row pays for its whole history's
expansion, so decode steps stay absorbed, and in a mixed step only the prefill chunks that gain
run expanded, beside the absorbed decode rows (TP, DP); a prefill chunk of about 100 rows or
more over any history runs expanded (measured on an H200 at DeepSeek-V3 dims,
``benchmarks/results/h200/expanded_prefill*.json``: 1.9-4.3× the absorbed form from 128 rows
up, a 64K prompt's time to first token 8.9 -> 2.8 s). ``SPLASH_MHA_PREFILL`` overrides it:
``off`` keeps every step absorbed, a number N runs every step of N rows or more on a rank
expanded. The expanded keys and values of one layer take at most ``EXPANDED_BUDGET`` bytes: a
longer history is expanded piece by piece (every row of the chunk sees a piece before the chunk
whole; the chunk itself is the causal piece) and the pieces' partial outputs merge by
log-sum-exp, as serving engines do for chunked prefill over long contexts. A step whose query
rows alone pass the budget stays absorbed, as do DSA layers that select positions (they attend
only the selected slots).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from splash import envs
from splash.core.mla_forms import expanded_wins
from splash.errors import ConfigError
from splash.kernels_triton import kv_gather, lse_merge
from splash.kernels_triton.mha_extend import mha_extend
from splash.layouts.base import KVStore, StepMeta, attend, query

EXPANDED_BUDGET = 1 << 30  # bytes of expanded keys and values one layer may hold at once


def mode() -> str | int:
    """``SPLASH_MHA_PREFILL``: "auto" (the FLOP rule, the default), "off", or a row count."""
    value = envs.get("SPLASH_MHA_PREFILL").strip().lower() or "auto"
    if value in ("auto", "off"):
        return value
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"SPLASH_MHA_PREFILL={value!r} must be auto, off or a number of "
                          "rows (at least 1)")
    return int(value)


def budget_keys(attn: Any) -> int:
    """History rows whose expanded keys and values fit ``EXPANDED_BUDGET`` in this layer."""
    c = attn.cfg
    per_key = attn.num_heads * (c.qk_nope_head_dim + c.v_head_dim) + c.qk_rope_head_dim
    return max(EXPANDED_BUDGET // (per_key * attn.w_uk.element_size()), 1)


def crossover_rows(cfg: Any, history: int = 8192) -> int:
    """The fewest rows of a prefill chunk over ``history`` earlier rows that run expanded."""
    return next((q for q in range(2, 1 << 16) if expanded_wins(cfg, [q], [history + q])), 0)


def use_expanded(attn: Any, meta: StepMeta, q_lens: list[int], kv_lens: list[int]) -> bool:
    """Whether a prefill step's requests on this rank, of ``q_lens`` query rows over
    ``kv_lens`` history rows, run expanded in this layer."""
    if meta.all_decode:  # decode steps stay absorbed: decided before anything else
        return False
    rows, how = sum(q_lens), mode()
    if how == "off" or not 0 < rows <= budget_keys(attn):
        return False
    if attn.is_sparse and not meta.within_topk(attn.cfg.index_topk):
        return False
    return rows >= how if isinstance(how, int) else expanded_wins(attn.cfg, q_lens, kv_lens)


def expanded_requests(attn: Any, meta: StepMeta, reqs: list[int]) -> list[int]:
    """The requests of ``reqs`` (this rank's, TP or DP) whose rows run expanded in this layer
    (`attend_split`). Under "auto" the FLOPs of each request decide its form alone (the cost of
    a form adds up request by request): a long prefill chunk runs expanded, the decode rows
    beside it absorbed; a forced row count takes the whole step or none of it."""
    if meta.all_decode:  # decode steps stay absorbed: decided before anything else
        return []
    q_lens, kv_lens = meta.host_lens(reqs)
    if mode() != "auto":
        return reqs if use_expanded(attn, meta, q_lens, kv_lens) else []
    if attn.is_sparse and not meta.within_topk(attn.cfg.index_topk):
        return []
    chosen = [b for b, q, k in zip(reqs, q_lens, kv_lens)
              if q > 1 and expanded_wins(attn.cfg, [q], [k])]
    rows = sum(meta.plan.query_lens[b] for b in chosen)
    return chosen if rows <= budget_keys(attn) else []


def attend_split(store: KVStore, layer: int, attn: Any, hs: torch.Tensor, pos: torch.Tensor,
                 meta: StepMeta, layout: Any, reqs: list[int], chosen: list[int],
                 args: dict) -> torch.Tensor:
    """The attention output (n, hidden; partial sums under TP) of the rows of ``reqs`` (``hs``,
    ``pos``: their rows in request order, written already; ``args``: their kernel arguments):
    the rows of ``chosen`` expanded, the others absorbed."""
    if len(chosen) == len(reqs):
        return attn.output_expanded(attend_expanded(store, layer, attn, attn.q_input(hs), pos,
                                                    meta, reqs, args))
    picked = set(chosen)
    rest = [b for b in reqs if b not in picked]
    starts = np.cumsum([0] + [meta.plan.query_lens[b] for b in reqs])
    at = {b: j for j, b in enumerate(reqs)}

    def rows_of(sub: list[int]) -> torch.Tensor:
        idx = np.concatenate([np.arange(starts[at[b]], starts[at[b] + 1]) for b in sub])
        return torch.from_numpy(idx).to(hs.device)

    def args_of(sub: list[int]) -> dict:
        return meta.cached(("args", layout.name, tuple(sub)), lambda: meta.kernel_args(layout, sub))

    ie, ir = rows_of(chosen), rows_of(rest)
    out = hs.new_empty((hs.shape[0], attn.cfg.hidden_size))
    out[ie] = attn.output_expanded(attend_expanded(store, layer, attn, attn.q_input(hs[ie]),
                                                   pos[ie], meta, chosen, args_of(chosen)))
    _, q = query(attn, hs[ir], pos[ir])
    o, _ = attend(q, store, layer, args_of(rest), attn.sm_scale, attn.cfg.kv_lora_rank)
    out[ir] = attn.output(o)
    return out


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


def dequantised(rows: torch.Tensor, scale: torch.Tensor | None,
                dtype: torch.dtype) -> torch.Tensor:
    """Latent rows (N, D) in ``dtype``; fp8 rows times their per-row ``scale`` (N,)."""
    if scale is None:
        return rows.to(dtype)
    return (rows.float() * scale.reshape(-1)[:, None]).to(dtype)


def attend_rows(attn: Any, rows: torch.Tensor, q_in: torch.Tensor, positions: torch.Tensor,
                args: dict, k_start: torch.Tensor, host: tuple[list[int], list[int], list[int]],
                config: dict | None, budget: int | None = None) -> torch.Tensor:
    """The expanded attention output (n, h, v) of query rows (``q_in``: their normalised q_a
    latents, ``positions``) over history ``rows`` (Nk, L + R): request b's keys are
    [k_start[b], k_start[b] + args["seq_lens"][b]); ``host`` holds its query rows, history
    length and key start on the host (to cut histories of more than ``budget`` rows, default
    `budget_keys`, into pieces)."""
    q = attn.query_expanded(q_in, positions)
    step = budget or budget_keys(attn)
    if rows.shape[0] <= step:  # the whole step at once
        return _attend(attn, q, rows, args["q_start_loc"], k_start, args["seq_lens"], True,
                       config)[0]
    out = q.new_empty((q.shape[0], q.shape[1], attn.cfg.v_head_dim))
    r0 = 0
    for n, kv_len, k0 in zip(*host):
        if n == 0:
            continue
        qb, prefix = q[r0:r0 + n], kv_len - n
        pieces = [(a, min(a + step, prefix), False) for a in range(0, prefix, step)]
        acc = None  # the running merge: two partials in memory at a time
        for a, b, causal in pieces + [(prefix, kv_len, True)]:
            part = _attend(attn, qb, rows[k0 + a:k0 + b], *_one(n, b - a, q.device), causal,
                           config)
            acc = part if acc is None else lse_merge(torch.stack([acc[0], part[0]]),
                                                     torch.stack([acc[1], part[1]]))
        assert acc is not None  # the chunk's own piece always runs
        out[r0:r0 + n] = acc[0]
        r0 += n
    return out


def warm_expanded(attn: Any, device: torch.device) -> None:
    """Compile ahead what the expanded form launches that the start-up warm-up's prompts may
    not reach: the non-causal pieces of a history past the budget and their log-sum-exp merge
    (with the causal chunk): one request of 2 query rows over 5 history rows, cut into pieces
    of 2. A no-op when ``SPLASH_MHA_PREFILL`` is off."""
    if mode() == "off":
        return
    c, dtype = attn.cfg, attn.w_uk.dtype
    rows = torch.zeros((5, c.kv_lora_rank + c.qk_rope_head_dim), dtype=dtype, device=device)
    q_in = torch.zeros((2, attn.q_b.shape[-1]), dtype=dtype, device=device)
    args = {"q_start_loc": torch.tensor([0, 2], dtype=torch.int32, device=device),
            "seq_lens": torch.tensor([5], dtype=torch.int32, device=device)}
    k_start = torch.zeros(1, dtype=torch.int32, device=device)
    positions = torch.tensor([3, 4], device=device)
    attend_rows(attn, rows, q_in, positions, args, k_start, ([2], [5], [0]), None, budget=2)


def _one(rows: int, keys: int, device: torch.device
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q_start_loc, k_start, seq_lens of one request of ``rows`` rows over ``keys`` keys."""
    def t(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)
    return t([0, rows]), t([0]), t([keys])


def _attend(attn: Any, q: torch.Tensor, rows: torch.Tensor, q_start: torch.Tensor,
            k_start: torch.Tensor, seq_lens: torch.Tensor, causal: bool,
            config: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
    L = attn.cfg.kv_lora_rank
    k_nope, v = attn.expand(rows[:, :L])
    return mha_extend(q, k_nope, rows[:, L:].to(q.dtype).contiguous(), v, q_start, k_start,
                      seq_lens, attn.sm_scale, causal=causal, config=config)


def attend_expanded(store: KVStore, layer: int, attn: Any, q_in: torch.Tensor,
                    positions: torch.Tensor, meta: StepMeta, reqs: list[int],
                    args: dict) -> torch.Tensor:
    """The attention output (n, h, v) of this rank's rows of ``reqs`` over their whole
    histories (written already), in the expanded form; ``attn.output_expanded`` projects it."""
    slots, k_start = meta.cached(("expanded", tuple(reqs)), lambda: history_slots(meta, reqs))
    cache, scale = store.layer(layer)
    got = kv_gather(cache, slots, kv_scale=scale)
    raw, row_scale = got if isinstance(got, tuple) else (got, None)
    rows = dequantised(raw, row_scale, attn.w_uk.dtype)
    lens = [meta.plan.context_lens[b] for b in reqs]
    host = ([meta.plan.query_lens[b] for b in reqs], lens,
            [sum(lens[:j]) for j in range(len(lens))])
    return attend_rows(attn, rows, q_in, positions, args, k_start, host,
                       store.configs.get("mha_extend") or None)
