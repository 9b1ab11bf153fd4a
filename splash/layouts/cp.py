"""CP: replicated projections, each request's pages round-robin over ranks.

Decode: every rank attends the (replicated) query over its local pages and returns (o, lse);
the partials are all-gathered and merged by log-sum-exp. Prefill: the chunk's requests'
histories are all-gathered per layer into a transient paged buffer (latent KV is small), the
query rows are split over ranks, and the output rows are all-gathered; only owned pages stay.
DSA: decode rows pick their positions in two rounds over the shards (``pick_slots_sharded``);
prefill rows gather the indexer keys into the transient buffer too and pick there.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from splash.core.ownership import LAYOUTS, cp_gather_map
from splash.kernels_triton import kv_gather, lse_merge, mla_extend, mla_sparse
from splash.layouts.base import AttentionLayout, StepMeta, attend, query, store_rows
from splash.layouts.expanded import attend_rows, dequantised, use_expanded
from splash.layouts.sparse import pick_slots_sharded, topk_indexed
from splash.model import overlap


class CPAttention(AttentionLayout):
    layout = LAYOUTS["cp"]

    def inputs(self, meta: StepMeta) -> dict[str, Any]:
        everyone = list(range(meta.num_requests))
        inp: dict[str, Any] = {"slots": meta.write_slots(self.layout, everyone)}
        dec = [b for b in everyone if meta.plan.query_lens[b] == 1]
        if dec:
            inp.update(dec_rows=meta.rows(dec), dec_args=meta.kernel_args(self.layout, dec))
        return inp

    def forward(self, layer: int, attn: Any, h: torch.Tensor, meta: StepMeta) -> torch.Tensor:
        inp = meta.inputs(self)

        def store() -> None:
            store_rows(self.store, layer, attn, h, meta.positions, inp["slots"])  # holders only

        out = torch.zeros_like(h)
        pre = [b for b in range(meta.num_requests) if meta.plan.query_lens[b] > 1]
        if "dec_rows" not in inp:
            store()
        else:
            rows = inp["dec_rows"]
            hs, pos = h[rows], meta.positions[rows]
            _, (q_in, q) = overlap.both(store, lambda: query(attn, hs, pos))  # q (n, H, D)
            slots = pick_slots_sharded(self.comm, self.store, layer, attn, hs, q_in, pos,
                                       inp["dec_args"], meta, "cp.dec")
            o, lse = attend(q, self.store, layer, inp["dec_args"], attn.sm_scale,
                            self.kv_lora_rank, slots)
            o_all = self.comm.all_gather_same(o)  # (T, n, H, L)
            lse_all = self.comm.all_gather_same(lse)  # (T, n, H)
            o, _ = lse_merge(o_all, lse_all)
            out[rows] = attn.output(o.to(h.dtype))
        if pre:
            out_rows, result = self._prefill(layer, attn, h, meta, pre)
            out[out_rows] = result
        return out

    def _transient(self, pool: torch.Tensor, scale: torch.Tensor | None,
                   plan: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The chunk's requests' whole histories of one per-slot pool (latent rows or indexer
        keys, + fp8 scales), gathered from every rank into a transient paged buffer."""
        ps, width = pool.shape[1], pool.shape[2]
        gathered_local = kv_gather(pool, plan["local_slots"], kv_scale=scale)
        local, local_scale = gathered_local if scale is not None else (gathered_local, None)
        rows = self.comm.all_gather_rows(local, plan["counts"])  # every held row, rank order
        flat = torch.zeros((plan["num_pages"] * ps, width), dtype=pool.dtype, device=pool.device)
        flat[plan["dst"]] = rows
        t_scale = None
        if local_scale is not None:
            all_scale = self.comm.all_gather_rows(local_scale, plan["counts"])
            t_scale = torch.zeros(plan["num_pages"] * ps, dtype=local_scale.dtype,
                                  device=pool.device)
            t_scale[plan["dst"]] = all_scale
            t_scale = t_scale.view(plan["num_pages"], ps)
        return flat.view(plan["num_pages"], ps, width), t_scale

    def _prefill(self, layer: int, attn: Any, h: torch.Tensor, meta: StepMeta, pre: list[int]):
        plan = meta.cached("cp.pre_plan", lambda: self._prefill_plan(meta, pre))
        transient, t_scale = self._transient(*self.store.layer(layer), plan)
        sparse = attn.is_sparse and not meta.within_topk(attn.cfg.index_topk)
        keys = None
        if sparse and attn.indexer is not None:  # every rank gathers, rows or not
            keys = self._transient(*self.store.index_layer(layer), plan)
        q_rows = plan["my_rows"]
        if q_rows.numel() and not sparse and use_expanded(attn, meta, *plan["host_lens"]):
            hs, pos = h[q_rows], meta.positions[q_rows]  # a long prefill: expanded form
            rows = dequantised(transient.view(-1, transient.shape[2]), t_scale, attn.w_uk.dtype)
            mine = attn.output_expanded(attend_rows(
                attn, rows, attn.q_input(hs), pos, plan, plan["k_start"],
                (*plan["host_lens"], plan["k_start_host"]),
                self.store.configs.get("mha_extend") or None))
        elif q_rows.numel():
            hs, pos = h[q_rows], meta.positions[q_rows]
            q_in, q = query(attn, hs, pos)  # q (m, H, D)
            args = {k: plan[k] for k in ("block_table", "seq_lens", "q_start_loc", "row_req")}
            args["max_rows"] = max(plan["host_lens"][0], default=1)
            if keys is not None:
                ix = attn.indexer
                meta.selection["cp.pre"] = topk_indexed(
                    ix.query(q_in, pos), ix.head_weights(hs), *keys, args,
                    ix.softmax_scale, ix.topk, self.store.configs, plan["host_lens"])[1]
            if sparse:
                o, _ = mla_sparse(q, transient, meta.selection["cp.pre"], attn.sm_scale,
                                  self.kv_lora_rank, kv_scale=t_scale)
            else:
                o, _ = mla_extend(q, transient, args["block_table"], args["seq_lens"],
                                  args["q_start_loc"], attn.sm_scale, self.kv_lora_rank,
                                  kv_scale=t_scale, max_rows=args.get("max_rows"))
            mine = attn.output(o)
        else:
            mine = h.new_zeros((0, h.shape[1]))
        gathered = self.comm.all_gather_rows(mine, plan["row_counts"])
        return plan["all_rows"], gathered

    def _prefill_plan(self, meta: StepMeta, pre: list[int]) -> dict:
        """Where each held row lands in the transient buffer, and this rank's query share."""
        world, rank, ps, plan = meta.world, meta.rank, meta.page_size, meta.plan
        dev = meta.device
        ctx = np.array([plan.context_lens[b] for b in pre], dtype=np.int64)
        pages = -(-ctx // ps)
        page_base = np.concatenate([[0], np.cumsum(pages)[:-1]])  # first page of each request
        base_page = int(pages.sum())
        gmap = cp_gather_map(ctx, world, ps)  # every held row, rank by rank
        dst = page_base[gmap.request] * ps + gmap.position
        mine = gmap.rank == rank
        tables = [meta.tables[b] for b in pre]
        local_slots = [tables[j][k // ps] * ps + k % ps
                       for j, k in zip(gmap.request[mine].tolist(), gmap.local_row[mine].tolist())]
        # query rows split over ranks in contiguous pieces; each piece keeps its request's
        # causal view by truncating that request's KV length at the piece's last row
        all_rows = [i for b in pre for i in range(meta.row_start[b], meta.row_start[b + 1])]
        bounds = [len(all_rows) * r // world for r in range(world + 1)]
        row_counts = [bounds[r + 1] - bounds[r] for r in range(world)]
        my = range(bounds[rank], bounds[rank + 1])
        block_tables, lens, q_start, q_lens, k_start = [], [], [0], [], []
        width = int(pages.max())
        seen = 0
        for j, b in enumerate(pre):
            n = plan.query_lens[b]
            lo, hi = max(bounds[rank] - seen, 0), min(bounds[rank + 1] - seen, n)
            seen += n
            if lo >= hi:
                continue
            first, n_pages = int(page_base[j]), int(pages[j])
            block_tables.append(list(range(first, first + n_pages)) + [0] * (width - n_pages))
            k_start.append(first * ps)  # its rows in the transient, in position order
            lens.append(plan.context_lens[b] - (n - hi))
            q_start.append(q_start[-1] + hi - lo)
            q_lens.append(hi - lo)

        def t(x, dtype=torch.long):
            return torch.tensor(x, dtype=dtype, device=dev)

        return {
            "local_slots": t(local_slots), "counts": gmap.counts, "dst": t(dst),
            "num_pages": base_page, "all_rows": t(all_rows),
            "my_rows": t([all_rows[i] for i in my]), "row_counts": row_counts,
            "block_table": t(block_tables or [[0]], torch.int32), "seq_lens": t(lens, torch.int32),
            "q_start_loc": t(q_start, torch.int32), "k_start": t(k_start, torch.int32),
            "k_start_host": k_start,
            "row_req": t([j for j, n in enumerate(q_lens) for _ in range(n)], torch.int32),
            "host_lens": (q_lens, lens),
        }
