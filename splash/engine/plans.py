"""Turn a scheduled batch (+ a switch manifest) into one StepPlan per rank."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from splash.core.protocol import (
    WORKER_PROTOCOL_VERSION,
    PromptLogprobs,
    SeqSampling,
    StepPlan,
    SwitchPlan,
    TableUpdate,
)
from splash.core.request import Request


def seq_sampling(req: Request, eos_token_ids: Collection[int]) -> SeqSampling:
    """How the worker draws ``req``'s next token: its parameters, the tokens min_tokens still
    holds back, and n draws at an n-sample prompt's last row."""
    p = req.params
    banned: list[int] = []
    if len(req.output_token_ids) < p.min_tokens:
        banned = sorted((set() if p.ignore_eos else set(eos_token_ids)) | set(p.stop_token_ids or []))
    draws = req.group.n if req.group is not None and req.fork_pending else 1
    return SeqSampling(p.temperature, p.top_p, p.top_k, p.seed, p.logprobs, banned, draws)


def prompt_logprob_rows(req: Request, index: int, start: int, n: int) -> PromptLogprobs | None:
    """The rows of ``req``'s chunk [start, start + n) that score prompt tokens not scored yet
    (row at position q scores prompt token q + 1)."""
    if req.prompt_logprobs is None or req.params.prompt_logprobs is None:
        return None
    prompt = req.prompt_token_ids
    first = max(start, len(req.prompt_logprobs) - 1)
    stop = min(start + n, len(prompt) - 1)
    if first >= stop:
        return None
    return PromptLogprobs(index, first - start, prompt[first + 1:stop + 1], req.params.prompt_logprobs)


def build_plans(engine: Any, batch: Any, action: Any) -> list[StepPlan]:
    sched = engine.scheduler
    eos = engine.model_cfg.eos_token_ids
    ids: list[str] = []
    query_lens: list[int] = []
    context_lens: list[int] = []
    owners: list[int] = []
    input_ids: list[int] = []
    positions: list[int] = []
    sample: list[bool] = []
    sampling: list[SeqSampling] = []
    output_index: list[int] = []
    prompt_logprobs: list[PromptLogprobs] = []
    for b, (req, n) in enumerate(batch.entries):
        start = req.num_computed
        ids.append(req.request_id)
        query_lens.append(n)
        context_lens.append(start + n)
        owners.append(req.owner)
        input_ids.extend(req.token_at(i) for i in range(start, start + n))
        positions.extend(range(start, start + n))
        sample.append(start + n == req.num_tokens)
        sampling.append(seq_sampling(req, eos))
        output_index.append(len(req.output_token_ids))
        rows = prompt_logprob_rows(req, b, start, n)
        if rows is not None:
            prompt_logprobs.append(rows)
    released, sched.released = sched.released, []
    plans = []
    for rank in range(engine.world):
        updates = [TableUpdate(rid, s, pages) for rid, s, pages in sched.take_table_updates(rank)]
        switch = None
        if action is not None:
            m = action.manifest
            switch = SwitchPlan(m.src.name, m.dst.name, m.weights[rank], m.kv[rank],
                                mode=action.mode)
        plans.append(StepPlan(
            version=WORKER_PROTOCOL_VERSION, step=engine.step_count, layout=engine.layout,
            request_ids=ids, query_lens=query_lens, context_lens=context_lens, owners=owners,
            input_ids=input_ids, positions=positions, sample=sample, sampling=sampling,
            output_index=output_index, table_updates=updates, released=released, switch=switch,
            prompt_logprobs=prompt_logprobs if rank == 0 else [],
            page_copies=sched.take_copies(rank)))
    return plans
