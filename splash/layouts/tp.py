"""TP: head-sharded projections, replicated latent KV."""

from __future__ import annotations

from typing import Any

import torch

from splash.core.ownership import LAYOUTS
from splash.layouts.base import AttentionLayout, StepMeta, attend, store_rows
from splash.layouts.sparse import pick_slots


class TPAttention(AttentionLayout):
    layout = LAYOUTS["tp"]

    def inputs(self, meta: StepMeta) -> dict[str, Any]:
        reqs = list(range(meta.num_requests))
        return {"slots": meta.write_slots(self.layout, reqs),
                "args": meta.kernel_args(self.layout, reqs)}

    def forward(self, layer: int, attn: Any, h: torch.Tensor, meta: StepMeta) -> torch.Tensor:
        inp = meta.inputs(self)
        q = attn.query(h, meta.positions)  # (N, H/T, D)
        store_rows(self.store, layer, attn, h, meta.positions, inp["slots"])  # every rank, all
        # DSA: every rank picks the same positions for every row (replicated histories)
        slots = pick_slots(self.store, layer, attn, h, meta.positions, inp["args"], meta, "tp",
                           meta.host_lens(list(range(meta.num_requests))))
        o, _ = attend(q, self.store, layer, inp["args"], attn.sm_scale, self.kv_lora_rank, slots)
        return self.comm.all_reduce(attn.output(o))  # (N, hidden)
