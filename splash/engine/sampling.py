"""Rank 0's end of a step: the logits of the rows that sample, the draws (n at an n-sample
prompt's last row), min_tokens' banned tokens, and the logprobs asked for.

Logprobs are the log-softmax of the very fp32 logits the draw used, before temperature, top-k/p
and min_tokens' masking (vLLM's "raw" logprobs). Prompt logprobs score each prompt token by the
row before it; they are computed in slices, so a long prefill never holds a (rows, vocab) block.

At T > 1 a step whose draws are all greedy (nothing banned, no logprobs) is drawn by every rank
together instead (`greedy_draws`): each scores its slice of the vocabulary, and one small
all-gather of the slices' maxima gives every rank the tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from splash.core.protocol import SeqSampling, StepPlan, TokenLogprobs
from splash.dist.host_copy import to_device
from splash.model.model import MLAModel
from splash.model.sampler import sample, token_logprobs
from splash.sampling_params import sample_seed

_PROMPT_ROWS_PER_SLICE = 256  # prompt rows whose (rows, vocab) logits exist at once


def _logprob_rows(logits: torch.Tensor, tokens: torch.Tensor, ks: list[int]) -> list[TokenLogprobs]:
    chosen, ids, lps = token_logprobs(logits, tokens, max(ks))
    chosen_l, ids_l, lps_l, tok_l = chosen.tolist(), ids.tolist(), lps.tolist(), tokens.tolist()
    return [TokenLogprobs([tok_l[i]] + ids_l[i][:k], [chosen_l[i]] + lps_l[i][:k])
            for i, k in enumerate(ks)]


def _draw(logits: torch.Tensor, sp: list[SeqSampling], seeds: list[int | None],
          steps: list[int]) -> torch.Tensor:
    if any(s.banned for s in sp):
        logits = logits.clone()
        for j, s in enumerate(sp):
            if s.banned:
                logits[j, s.banned] = float("-inf")
    if all(s.temperature <= 0 for s in sp):  # all greedy: no parameter tensors, no sync
        return logits.argmax(dim=-1)
    return sample(logits, torch.tensor([s.temperature for s in sp]),
                  torch.tensor([s.top_p for s in sp]), torch.tensor([s.top_k for s in sp]),
                  seeds=seeds, steps=steps)


def sample_step(model: MLAModel, hidden: torch.Tensor, plan: StepPlan
                ) -> tuple[torch.Tensor | None, list[TokenLogprobs], list[list[TokenLogprobs]]]:
    """hidden (N, hidden) of the step's rows -> (the draws, on the device and not waited for;
    None when nothing samples), logprobs per draw that asked, prompt logprobs per
    ``plan.prompt_logprobs`` entry (these two wait for the device)."""
    starts = _row_starts(plan)
    rows: list[int] = []
    sp: list[SeqSampling] = []
    seeds: list[int | None] = []
    steps: list[int] = []
    for b, s in enumerate(plan.sample):
        if not s:
            continue
        cfg = plan.sampling[b]
        for i in range(cfg.draws):
            rows.append(int(starts[b + 1]) - 1)
            sp.append(cfg)
            seeds.append(sample_seed(cfg.seed, i))
            steps.append(plan.output_index[b])
    drawn = None
    logprobs: list[TokenLogprobs] = []
    if rows:
        unique = sorted(set(rows))  # a row drawn n times computes its logits once
        at = {r: i for i, r in enumerate(unique)}
        where = [at[r] for r in rows] if len(unique) < len(rows) else None
        logits = model.compute_logits(hidden[_index(unique, hidden.device)])
        if where is not None:
            logits = logits[_index(where, logits.device)]  # (draws, V)
        drawn = _draw(logits, sp, seeds, steps)
        want = [j for j, s in enumerate(sp) if s.logprobs is not None]
        if want:
            idx = torch.tensor(want, device=logits.device)
            logprobs = _logprob_rows(logits[idx], drawn[idx], [sp[j].logprobs or 0 for j in want])
    return drawn, logprobs, prompt_logprobs(model, hidden, plan)


def prompt_logprobs(model: MLAModel, hidden: torch.Tensor,
                    plan: StepPlan) -> list[list[TokenLogprobs]]:
    """Rank 0's prompt logprobs, per ``plan.prompt_logprobs`` entry (waits for the device)."""
    starts = _row_starts(plan)
    prompt: list[list[TokenLogprobs]] = []
    for pl in plan.prompt_logprobs:
        first = int(starts[pl.index]) + pl.first_row
        out: list[TokenLogprobs] = []
        for lo in range(0, len(pl.targets), _PROMPT_ROWS_PER_SLICE):
            hi = min(lo + _PROMPT_ROWS_PER_SLICE, len(pl.targets))
            logits = model.compute_logits(hidden[first + lo:first + hi])
            targets = torch.tensor(pl.targets[lo:hi], device=logits.device)
            out += _logprob_rows(logits, targets, [pl.k] * (hi - lo))
        prompt.append(out)
    return prompt


def split_greedy(plan: StepPlan) -> bool:
    """Whether the ranks may draw this step together, each scoring its vocabulary slice
    (`greedy_draws`): every draw greedy, nothing banned, no logprobs asked. Decided from what
    every rank's plan holds alike."""
    return any(plan.sample) and all(
        cfg.temperature <= 0 and not cfg.banned and cfg.logprobs is None
        for s, cfg in zip(plan.sample, plan.sampling) if s)


def greedy_draws(model: MLAModel, hidden: torch.Tensor, plan: StepPlan, rank: int, world: int,
                 all_gather: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Greedy draws of a step (`split_greedy`) on every rank: each rank scores its slice of
    the vocabulary, and the best of the slices' maxima wins (the first on ties: the lowest
    token id, as one argmax over the whole vocabulary picks). Reads 1 / world of the LM head
    per rank instead of all of it on rank 0, and leaves the draws on every rank."""
    starts = _row_starts(plan)
    rows = [int(starts[b + 1]) - 1 for b, s in enumerate(plan.sample) if s
            for _ in range(plan.sampling[b].draws)]
    head = model.lm_head
    per = -(-head.shape[0] // world)
    lo = min(rank * per, head.shape[0])
    h = hidden[_index(rows, hidden.device)].to(head.dtype)
    logits = (h @ head[lo:lo + per].t()).float()  # (draws, per) — empty for a rank past V
    if logits.shape[1]:
        best, at = logits.max(dim=-1)
    else:
        best = torch.full((len(rows),), float("-inf"), device=hidden.device)
        at = torch.zeros(len(rows), dtype=torch.long, device=hidden.device)
    both = all_gather(torch.stack((best.double(), (at + lo).double()), dim=-1))  # (T, n, 2)
    winner = both[..., 0].argmax(dim=0)  # (n,) the first rank holding the maximum
    return both[winner, torch.arange(len(rows), device=hidden.device), 1].long()


def num_draws(plan: StepPlan) -> int:
    """Tokens a step draws (every rank knows it from the plan)."""
    return sum(cfg.draws for s, cfg in zip(plan.sample, plan.sampling) if s)


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    """Row indices on ``device``, copied without waiting for it."""
    return to_device(torch.tensor(rows, dtype=torch.long), device)


def _row_starts(plan: StepPlan) -> np.ndarray:
    """Each request's first row in the step (and the end of the last)."""
    return np.concatenate([[0], np.cumsum(plan.query_lens)])
