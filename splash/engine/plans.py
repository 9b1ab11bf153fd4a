"""Turn a scheduled batch (+ a switch manifest) into one StepPlan per rank."""

from __future__ import annotations

from splash.core.protocol import (
    WORKER_PROTOCOL_VERSION,
    SeqSampling,
    StepPlan,
    SwitchPlan,
    TableUpdate,
)
from splash.engine.scheduler import ScheduledBatch, Scheduler
from splash.engine.switches import SwitchStep


def build_plans(sched: Scheduler, batch: ScheduledBatch, action: SwitchStep | None,
                step: int) -> list[StepPlan]:
    """One plan per rank for engine step ``step``: the batch's rows, the rank's block-table
    changes and, with a switch, the rank's part of this step's ``action``."""
    ids: list[str] = []
    query_lens: list[int] = []
    context_lens: list[int] = []
    owners: list[int] = []
    input_ids: list[int] = []
    positions: list[int] = []
    sample: list[bool] = []
    sampling: list[SeqSampling] = []
    output_index: list[int] = []
    for req, n in batch.entries:
        start = req.num_computed
        ids.append(req.request_id)
        query_lens.append(n)
        context_lens.append(start + n)
        owners.append(req.owner)
        input_ids.extend(req.token_at(i) for i in range(start, start + n))
        positions.extend(range(start, start + n))
        sample.append(start + n == req.num_tokens)
        p = req.params
        sampling.append(SeqSampling(p.temperature, p.top_p, p.top_k, p.seed))
        output_index.append(len(req.output_token_ids))
    released, sched.released = sched.released, []
    kv_moves = action is not None and any(x.kv_rows_received for x in action.manifest.summary)
    plans = []
    for rank in range(sched.cfg.world):
        updates = [TableUpdate(rid, s, pages) for rid, s, pages in sched.take_table_updates(rank)]
        switch = None
        if action is not None:
            m = action.manifest
            switch = SwitchPlan(m.src.name, m.dst.name, m.weights[rank], m.kv[rank],
                                mode=action.mode, kv_moves=kv_moves)
        plans.append(StepPlan(
            version=WORKER_PROTOCOL_VERSION, step=step, layout=sched.layout.name,
            request_ids=ids, query_lens=query_lens, context_lens=context_lens, owners=owners,
            input_ids=input_ids, positions=positions, sample=sample, sampling=sampling,
            output_index=output_index, table_updates=updates, released=released, switch=switch))
    return plans
