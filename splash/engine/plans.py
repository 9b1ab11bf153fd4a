"""Turn a scheduled batch (+ a switch manifest) into one StepPlan per rank."""

from __future__ import annotations

from typing import Any

from splash.core.protocol import (
    WORKER_PROTOCOL_VERSION,
    PromptLogprobs,
    SeqSampling,
    StepPlan,
    SwitchPlan,
    TableUpdate,
    run_rows,
)
from splash.engine.sampling_plan import prompt_logprob_rows, seq_sampling
from splash.engine.scheduler import ScheduledBatch, Scheduler
from splash.engine.setup import EngineSetup
from splash.engine.switches import SwitchStep
from splash.switching.manifest import SwitchManifest


def build_plans(sched: Scheduler, batch: ScheduledBatch, action: SwitchStep | None,
                step: int, setup: EngineSetup | None = None,
                share_samples: bool = False) -> list[StepPlan]:
    """One plan per rank for engine step ``step``: the batch's rows, the rank's block-table
    changes and, with a switch, the rank's part of this step's ``action`` (``setup`` sizes
    its collectives). Tokens still in flight (`Scheduler.advance`) come from step - 1's draws
    on the workers; ``share_samples``: every rank keeps this step's draws for the next."""
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
    eos = sched.cfg.eos_token_ids
    in_flight = False
    for b, (req, n) in enumerate(batch.entries):
        start = batch.starts[b]
        in_flight |= req.pending > 0
        ids.append(req.request_id)
        query_lens.append(n)
        context_lens.append(start + n)
        owners.append(req.owner)
        input_ids.extend(req.token_at(i) for i in range(start, start + n))
        positions.extend(range(start, start + n))
        sample.append(batch.samples[b])
        sampling.append(seq_sampling(req, eos))
        output_index.append(req.num_outputs)
        rows = prompt_logprob_rows(req, b, start, n)
        if rows is not None:
            prompt_logprobs.append(rows)
    released, sched.released = sched.released, []
    shape = _collectives(setup, action.manifest) if action is not None else {}
    plans = []
    for rank in range(sched.cfg.world):
        updates = [TableUpdate(rid, s, pages) for rid, s, pages in sched.take_table_updates(rank)]
        switch = None
        if action is not None:
            m = action.manifest
            switch = SwitchPlan(m.src.name, m.dst.name, m.weights[rank], m.kv[rank],
                                mode=action.mode, **shape)
        plans.append(StepPlan(
            version=WORKER_PROTOCOL_VERSION, step=step, layout=sched.layout.name,
            request_ids=ids, query_lens=query_lens, context_lens=context_lens, owners=owners,
            input_ids=input_ids, positions=positions, sample=sample, sampling=sampling,
            output_index=output_index, table_updates=updates, released=released, switch=switch,
            prompt_logprobs=prompt_logprobs if rank == 0 else [],
            page_copies=sched.take_copies(rank),
            inputs_from_step=step - 1 if in_flight else -1, share_samples=share_samples))
    return plans


GROUP_BYTES = 1 << 29  # about this much per collective: large enough to reach the link (two
#   are in flight in a blocking switch: one packs or unpacks while the other moves)


def collective_shape(m: SwitchManifest, kv_row_bytes: int, head_bytes: int) -> dict[str, Any]:
    """Which collectives a switch has and how many layers share one — identical on every rank
    (a rank that skipped a collective its peers entered would hang them). ``kv_row_bytes``:
    one token's KV in one layer; ``head_bytes``: one head's projections in one layer."""
    kv_rows = max(max(sum(run_rows(r) for r in mv.send_runs),
                      sum(run_rows(r) for r in mv.recv_runs)) for mv in m.kv)
    heads = max(max(sum(len(h) for h in w.send_to), sum(len(h) for h in w.recv_from))
                for w in m.weights)
    per_layer = kv_rows * kv_row_bytes + heads * head_bytes
    return {"kv_moves": kv_rows > 0, "heads_move": heads > 0,
            "layers_per_group": max(GROUP_BYTES // max(per_layer, 1), 1)}


def _collectives(setup: EngineSetup | None, m: SwitchManifest) -> dict[str, Any]:
    if setup is None:
        raise ValueError("a plan with a switch needs the engine's setup (collective sizes)")
    mem, mcfg = setup.memory, setup.model_cfg
    # a KV row carries every per-slot pool of its layer (DSA: the indexer key too)
    return collective_shape(m, -(-mem.kv_bytes_per_token // mcfg.num_hidden_layers),
                            mem.projection_bytes_per_layer // mcfg.num_attention_heads)
