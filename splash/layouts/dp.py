"""DP-attention: replicated projections, owner-held KV; output rows all-gathered."""

from __future__ import annotations

from typing import Any

import torch

from splash.core.ownership import LAYOUTS
from splash.layouts.base import AttentionLayout, StepMeta, attend, query, store_rows
from splash.layouts.expanded import attend_split, expanded_requests
from splash.layouts.sparse import pick_slots
from splash.model import overlap


class DPAttention(AttentionLayout):
    layout = LAYOUTS["dp"]

    def inputs(self, meta: StepMeta) -> dict[str, Any]:
        return self.owner_inputs(meta)

    def forward(self, layer: int, attn: Any, h: torch.Tensor, meta: StepMeta) -> torch.Tensor:
        inp = meta.inputs(self)
        mine = meta.owned(self.comm.rank)
        chosen = expanded_requests(attn, meta, mine) if "rows" in inp else []
        if chosen:  # long prefill chunks expanded (this rank's other rows absorbed)
            rows = inp["rows"]
            hs, pos = h[rows], meta.positions[rows]
            store_rows(self.store, layer, attn, hs, pos, inp["slots"])
            out = attend_split(self.store, layer, attn, hs, pos, meta, self.layout, mine, chosen,
                               inp["args"])
        elif "rows" in inp:
            rows = inp["rows"]
            hs, pos = h[rows], meta.positions[rows]
            _, (q_in, q) = overlap.both(
                lambda: store_rows(self.store, layer, attn, hs, pos, inp["slots"]),
                lambda: query(attn, hs, pos))  # q (n, H, D)
            slots = pick_slots(self.store, layer, attn, hs, q_in, pos, inp["args"], meta, "dp",
                               meta.host_lens(mine))
            o, _ = attend(q, self.store, layer, inp["args"], attn.sm_scale, self.kv_lora_rank,
                          slots)
            out = attn.output(o)  # (n, hidden), complete: all heads are here
        else:
            out = h.new_zeros((0, h.shape[1]))
        counts = meta.owned_rows()
        gathered = self.comm.all_gather_rows(out, counts)  # (N, hidden) in owner order
        result = torch.empty_like(h)
        result[inp["perm"]] = gathered
        return result
