"""DOP: head-sharded projections, owner-held KV (paper §3).

Each rank computes the absorbed query of its H/T heads for every row; an uneven all-to-all
sends each row's head slice to the row's owner, which stores the row's latent KV and attends
with all heads over its histories; the reverse all-to-all returns each head slice of the
latent output to its rank, which applies W_UV and its O shard; an all-reduce completes O.
Exchange volume scales with rows, never with context. Ranks with no rows still enter both
collectives.
"""

from __future__ import annotations

from typing import Any

import torch

from splash.core.ownership import LAYOUTS
from splash.kernels_triton import (
    gather_rows,
    merge_heads_from_ranks,
    scatter_rows,
    split_heads_to_ranks,
)
from splash.layouts.base import AttentionLayout, StepMeta, attend, query, store_rows
from splash.layouts.sparse import pick_slots
from splash.model import overlap


class DOPAttention(AttentionLayout):
    layout = LAYOUTS["dop"]

    def inputs(self, meta: StepMeta) -> dict[str, Any]:
        return self.owner_inputs(meta)

    def forward(self, layer: int, attn: Any, h: torch.Tensor, meta: StepMeta) -> torch.Tensor:
        world, rank = self.comm.world, self.comm.rank
        inp = meta.inputs(self)
        counts = meta.owned_rows()
        perm = inp["perm"]
        n_own = counts[rank]

        def exchange() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            q_in, q = query(attn, h, meta.positions)  # q (N, H/T, D)
            send = gather_rows(q, perm)  # (N, H/T, D) grouped by owner
            recv, _ = self.comm.all_to_all_rows(send, counts, [n_own] * world)  # (T*n_own, ..)
            return q_in, q, recv

        if n_own:  # the owned rows' latent is written while the queries are exchanged
            rows = inp["rows"]
            hs, pos = h[rows], meta.positions[rows]
            _, (q_in, q, recv) = overlap.both(
                lambda: store_rows(self.store, layer, attn, hs, pos, inp["slots"]), exchange)
        else:
            q_in, q, recv = exchange()
        q_own = merge_heads_from_ranks(recv.view(world, n_own, *q.shape[1:]), world)  # (n, H, D)
        if n_own:
            # DSA: the owner runs the (replicated) indexer for its rows
            slots = pick_slots(self.store, layer, attn, hs, q_in[rows], pos, inp["args"], meta,
                               "dop", meta.host_lens(meta.owned(rank)))
            o_own, _ = attend(q_own, self.store, layer, inp["args"], attn.sm_scale,
                              self.kv_lora_rank, slots)
        else:
            o_own = q_own.new_zeros((0, q_own.shape[1], self.kv_lora_rank))  # (0, H, L)
        back = split_heads_to_ranks(o_own, world)  # (T, n_own, H/T, L)
        back = back.reshape(world * n_own, *back.shape[2:])
        o_rows, _ = self.comm.all_to_all_rows(back, [n_own] * world, counts)  # (N, H/T, L)
        o = torch.empty_like(o_rows)
        scatter_rows(o, perm, o_rows)  # back to step row order
        return self.comm.sum_partials(attn.output(o))  # (N, hidden)
