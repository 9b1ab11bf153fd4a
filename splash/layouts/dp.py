"""DP-attention: replicated projections, owner-held KV; output rows all-gathered (DESIGN §2)."""

from __future__ import annotations

from typing import Any

import torch

from splash.layouts.base import AttentionLayout, StepMeta, attend, write_kv
from splash.layouts.ownership import LAYOUTS


class DPAttention(AttentionLayout):
    layout = LAYOUTS["dp"]

    def forward(self, layer: int, attn: Any, h: torch.Tensor, meta: StepMeta) -> torch.Tensor:
        world = self.comm.world
        owned = [meta.owned(r) for r in range(world)]
        mine = owned[self.comm.rank]
        rows = meta.cached("dp.rows", lambda: meta.rows(mine))
        if mine:
            hs, pos = h[rows], meta.positions[rows]
            q = attn.query(hs, pos)  # (n, H, D)
            slots = meta.cached("dp.slots", lambda: meta.write_slots(self.layout, mine))
            write_kv(self.store, layer, attn.latent(hs, pos), slots)
            args = meta.cached("dp.args", lambda: meta.kernel_args(self.layout, mine))
            o, _ = attend(q, self.store, layer, args, attn.sm_scale, self.kv_lora_rank)
            out = attn.output(o)  # (n, hidden), complete: all heads are here
        else:
            out = h.new_zeros((0, h.shape[1]))
        counts = [sum(meta.plan.query_lens[b] for b in reqs) for reqs in owned]
        gathered = self.comm.all_gather_rows(out, counts)  # (N, hidden) in owner order
        order = meta.cached("dp.order", lambda: meta.rows([b for reqs in owned for b in reqs]))
        result = torch.empty_like(h)
        result[order] = gathered
        return result
