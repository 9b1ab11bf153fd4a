"""TP: head-sharded projections, replicated latent KV."""

from __future__ import annotations

from typing import Any

import torch

from splash.core.ownership import LAYOUTS
from splash.layouts.base import AttentionLayout, StepMeta, attend, query, store_rows
from splash.layouts.expanded import attend_split, expanded_requests
from splash.layouts.sparse import pick_slots
from splash.model import overlap


class TPAttention(AttentionLayout):
    layout = LAYOUTS["tp"]

    def inputs(self, meta: StepMeta) -> dict[str, Any]:
        reqs = list(range(meta.num_requests))
        return {"slots": meta.write_slots(self.layout, reqs),
                "args": meta.kernel_args(self.layout, reqs)}

    def forward(self, layer: int, attn: Any, h: torch.Tensor, meta: StepMeta) -> torch.Tensor:
        inp = meta.inputs(self)
        reqs = list(range(meta.num_requests))
        chosen = expanded_requests(attn, meta, reqs)
        if chosen:  # long prefill chunks expanded (the step's other rows absorbed)
            store_rows(self.store, layer, attn, h, meta.positions, inp["slots"])
            return self.comm.sum_partials(attend_split(
                self.store, layer, attn, h, meta.positions, meta, self.layout, reqs, chosen,
                inp["args"]))
        _, (q_in, q) = overlap.both(  # every rank writes all rows
            lambda: store_rows(self.store, layer, attn, h, meta.positions, inp["slots"]),
            lambda: query(attn, h, meta.positions))  # q (N, H/T, D)
        # DSA: every rank picks the same positions for every row (replicated histories)
        slots = pick_slots(self.store, layer, attn, h, q_in, meta.positions, inp["args"], meta,
                           "tp", meta.host_lens(reqs))
        o, _ = attend(q, self.store, layer, inp["args"], attn.sm_scale, self.kv_lora_rank, slots)
        return self.comm.sum_partials(attn.output(o))  # (N, hidden)
