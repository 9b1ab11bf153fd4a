"""Per-step cost of each attention layout (paper Appendix B).

A stage costs max(FLOPs / peak, bytes / HBM bandwidth) on a rank (roofline), times the profile's
measured-to-roofline factor (1 unless calibrated), plus a fixed cost per step and per request
(0 unless calibrated); every collective is
a barrier, so each stage costs its slowest rank and dependent stages add up. Collectives pay
`collective_latency_us` each plus bytes / link bandwidth; a fraction `overlap_fraction` of the
bandwidth time can hide behind attention. MLP/MoE (tensor-parallel over all T ranks in every
layout) and the LM head are included so that layout ratios are realistic.

Absorbed MLA: a query row costs 2·h·(D + L) FLOPs per attended KV token (D = L + R); KV bytes read
grow with context. A prefill chunk that the engine runs expanded (``splash.core.mla_forms``: TP,
DP and CP, where that is faster) costs its expanded FLOPs at the measured speed-up instead, less
the absorbed form's W_UK / W_UV products the projections count; DOP stays absorbed. DSA models (`index_topk`) attend at most `index_topk` tokens per row and pay a
lightning indexer over the whole history (2·index_heads·index_dim FLOPs per token, fp8 keys).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from splash.backends.profiles import HardwareProfile
from splash.core.dtypes import dtype_bytes
from splash.core.memory import MemoryModel
from splash.core.mla_forms import EXPANDED_SPEED, faster_expanded, request_macs
from splash.core.ownership import KVPlacement, Layout, assign_owners, get_layout, held_tokens
from splash.core.shapes import BatchShape, SwitchCost
from splash.planning.feasibility import ACT_BYTES

__all__ = ["BatchShape", "CostModel", "SwitchCost"]
LSE_BYTES = 4


@dataclass(frozen=True)
class CostModel:
    """Predicted step time of each layout for one model on ``world`` ranks of ``profile``."""

    cfg: Any  # ModelConfig (HF field names)
    world: int
    profile: HardwareProfile
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    page_size: int = 64
    sparse_attention: bool | None = None  # DSA top-k + indexer; None: when cfg has index_topk
    resident_heads: bool = False  # every layout's projection heads held: switches move no weights
    memory: MemoryModel = field(init=False, repr=False, compare=False)
    _k: dict[str, Any] = field(init=False, repr=False, compare=False)  # derived constants

    def __post_init__(self) -> None:
        if self.world < 1:
            raise ValueError("world must be >= 1")
        object.__setattr__(self, "memory", MemoryModel(
            self.cfg, self.world, self.weight_dtype, self.kv_dtype, self.page_size))
        c = self.cfg
        wb = dtype_bytes(self.weight_dtype)
        q_in = c.q_lora_rank or c.hidden_size
        topk = getattr(c, "index_topk", None) or 0
        if self.sparse_attention is False:
            topk = 0
        idx_heads = (getattr(c, "index_n_heads", 0) or 0) if topk else 0
        idx_dim = (getattr(c, "index_head_dim", 0) or 0) if topk else 0
        common = c.hidden_size * (c.kv_lora_rank + c.qk_rope_head_dim)  # kv_a
        common += c.hidden_size * c.q_lora_rank if c.q_lora_rank else 0  # q_a
        common += q_in * idx_heads * idx_dim + c.hidden_size * (idx_dim + idx_heads)  # indexer
        num_moe = sum(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
        fp8_ok = wb == 1 and self.profile.peak_fp8_tflops > 0
        object.__setattr__(self, "_k", {
            "wb": wb,
            "gemm_tflops": self.profile.peak_fp8_tflops if fp8_ok else self.profile.peak_bf16_tflops,
            "topk": topk,
            "idx_flops_per_pair": 2 * idx_heads * idx_dim,
            "idx_bytes_per_token": idx_dim + 4 if idx_dim else 0,  # fp8 key + fp32 scale
            "common_params": common,
            "q_params_per_head": q_in * (c.qk_nope_head_dim + c.qk_rope_head_dim)
            + c.qk_nope_head_dim * c.kv_lora_rank,  # q_b + W_UK (absorption)
            "o_params_per_head": c.v_head_dim * (c.kv_lora_rank + c.hidden_size),  # W_UV + O
            "num_moe_layers": num_moe,
            "num_dense_layers": c.num_hidden_layers - num_moe,
        })

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        """Bytes one token's KV occupies and moves per layer (latent + DSA indexer key)."""
        return self.memory.kv_bytes_per_token_per_layer + self._k["idx_bytes_per_token"]

    # -- public ----------------------------------------------------------------------------
    def step_time_ms(self, layout: str | Layout, batch: BatchShape) -> float:
        """Predicted wall time of one engine step of ``batch`` under ``layout``."""
        return self.breakdown(layout, batch)["total"]

    def breakdown(self, layout: str | Layout, batch: BatchShape) -> dict[str, float]:
        """Stage times (ms, summed over layers), collective count and busiest-rank comm bytes."""
        lay = get_layout(layout) if isinstance(layout, str) else layout
        if batch.num_rows == 0:
            return {"total": 0.0}
        w = self._work(batch)
        st = self._attention_layer(lay, w)
        n = w["n"]
        mlp = self._mlp_ms(n)
        mlp_ar = self._allreduce(n * self.cfg.hidden_size * ACT_BYTES)
        layers = self.cfg.num_hidden_layers
        comm_ms = (st["comm_ms"] + mlp_ar[0]) * layers
        count = (st["count"] + mlp_ar[2]) * layers
        hidden = self.profile.overlap_fraction * min(st["comm_ms"], st["attention"]) * layers
        gs, at = self.profile.gemm_time_scale, self.profile.attention_time_scale
        out = {
            "common_proj": st["common"] * layers * gs,
            "proj": st["proj"] * layers * gs,
            "attention": st["attention"] * layers * at,
            "mlp": mlp * gs,
            "comm": comm_ms,
            "latency": count * self._latency_ms(),
            "hidden": -hidden,
            "lm_head": self._lm_head_ms(len(batch.decode_ctx) + len(batch.prefill)) * gs,
            "overhead": (self.profile.step_overhead_us
                         + batch.num_requests * self.profile.request_overhead_us) / 1e3,
        }
        out["total"] = sum(out.values())
        out["collectives"] = float(count)
        out["comm_bytes_per_rank"] = float((st["comm_bytes"] + mlp_ar[1]) * layers)
        return out

    def switch_cost(self, src: str, dst: str, batch: BatchShape,
                    live_tokens: Sequence[int] | np.ndarray | None = None,
                    live_owners: Sequence[int] | None = None) -> SwitchCost:
        """Bytes each rank receives per layer (the switch table of docs/switching.md) and the switch's time,
        switching before ``batch`` runs. ``live_tokens``: KV tokens of every live request
        (default: those of ``batch``); ``live_owners``: their owners (default: greedy)."""
        s, d = get_layout(src), get_layout(dst)
        T, layers = self.world, self.cfg.num_hidden_layers
        if live_tokens is None:
            tokens = np.maximum(batch.tokens_after() - 1, 0)
            owners = self._owners(batch, tokens)
        else:
            tokens = np.asarray(live_tokens, dtype=np.int64)
            owners = (self.owners(tokens) if live_owners is None
                      else np.asarray(live_owners, dtype=np.int64))
        prims: list[str] = []
        w_bytes = 0
        if s.shards_heads and not d.shards_heads and T > 1 and not self.resident_heads:
            w_bytes = self.memory.weight_allgather_bytes_per_rank_per_layer
            prims.append("weight all-gather")
        ps = self.page_size
        held_src = held_tokens(s, tokens, owners, T, ps, whole_pages=False)
        held_dst = held_tokens(d, tokens, owners, T, ps, whole_pages=False)
        kv_tokens = 0
        if s.kv != d.kv and T > 1:
            if d.kv is KVPlacement.REPLICATED:
                kv_tokens = int((held_dst - held_src).max())  # each rank gathers what it lacks
                prims.append("kv all-gather")
            elif s.kv is not KVPlacement.REPLICATED:  # CP <-> owned: (T-1)/T moves
                recv = held_dst * (T - 1) // T
                send = held_src * (T - 1) // T
                kv_tokens = int(np.maximum(recv, send).max())
                prims.append("kv all-to-all")
        kv_bytes = kv_tokens * self.kv_bytes_per_token_per_layer
        per_layer = (w_bytes + kv_bytes) / (self.profile.link_gbps * 1e9) * 1e3
        per_layer += len(prims) * self._latency_ms()
        per_layer *= self.profile.switch_time_scale
        fixed = self.profile.switch_overhead_us * 1e-3 if src != dst else 0.0
        compute = self.step_time_ms(d, batch) / layers if batch.num_rows else 0.0
        live = (layers - 1) * max(0.0, per_layer - compute) + per_layer if prims else 0.0
        return SwitchCost(src, dst, tuple(prims), w_bytes, kv_bytes, per_layer, live + fixed,
                          per_layer * layers + fixed)

    def switch_cost_ms(self, src: str, dst: str, batch: BatchShape,
                       live_tokens: Sequence[int] | np.ndarray | None = None,
                       live_owners: Sequence[int] | None = None) -> float:
        """Live (layer-pipelined) switch overhead in ms; 0 for pure discards."""
        if src == dst:
            return 0.0
        return self.switch_cost(src, dst, batch, live_tokens, live_owners).live_ms

    # -- pieces ----------------------------------------------------------------------------
    def owners(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        """Owners of live histories of ``tokens`` KV tokens placed together, as the engine
        places them entering an owned layout (`ownership.assign_owners`)."""
        return assign_owners(tokens, self.world)

    def _owners(self, batch: BatchShape, tokens: np.ndarray) -> np.ndarray:
        if batch.owners is not None:
            return np.minimum(np.asarray(batch.owners, dtype=np.int64), self.world - 1)
        return self.owners(tokens)

    def _roof(self, flops: Any, nbytes: Any, tflops: float) -> Any:
        """ms of a stage: FLOPs at peak or bytes at HBM bandwidth, whichever is slower."""
        return np.maximum(flops / (tflops * 1e9), nbytes / (self.profile.hbm_gbps * 1e6))

    def _latency_ms(self) -> float:
        return self.profile.collective_latency_us / 1e3 if self.world > 1 else 0.0

    def _link_ms(self, nbytes: float) -> float:
        return nbytes / (self.profile.link_gbps * 1e6)

    def _allreduce(self, nbytes: int) -> tuple[float, float, int]:
        """(bandwidth ms, bytes per rank, collective count) of a ring all-reduce."""
        if self.world == 1:
            return 0.0, 0.0, 0
        moved = 2 * (self.world - 1) / self.world * nbytes
        return self._link_ms(moved), moved, 1

    def _pairs(self, rows: np.ndarray, prefix: np.ndarray, sparse: bool) -> np.ndarray:
        """Attended (query row, KV token) pairs per request; causal within a chunk."""
        dense = rows * prefix + rows * (rows + 1) // 2
        k = self._k["topk"]
        if not sparse or not k:
            return dense
        # rows j = 1..n attend min(prefix + j, k) tokens
        m = np.clip(k - prefix, 0, rows)  # rows still below the top-k limit
        below = m * prefix + m * (m + 1) // 2
        return below + (rows - m) * k

    def _work(self, batch: BatchShape) -> dict[str, Any]:
        """Per-request attention work of ``batch`` (shared by every layout; memoised)."""
        cache = self.__dict__.setdefault("_work_cache", {})
        hit = cache.get(batch)
        if hit is not None:
            return hit
        c = self.cfg
        rows, prefix = batch.arrays()
        hist = rows + prefix
        k, ib = self._k["topk"], self._k["idx_bytes_per_token"]
        kvb = self.kv_bytes_per_token_per_layer
        kv_read = np.minimum(hist, rows * k) if k else hist  # DSA reads the top-k it gathers
        absorbed = self._pairs(rows, prefix, sparse=True) * 2.0 * (2 * c.kv_lora_rank
                                                                   + c.qk_rope_head_dim)
        per_req = np.stack([
            absorbed,  # per head
            (kv_read + rows) * float(kvb),  # KV read + the step's rows written
            self._pairs(rows, prefix, sparse=False) * float(self._k["idx_flops_per_pair"])
            if ib else np.zeros(len(rows)),
            hist * float(ib),
            *self._expanded(rows, prefix, absorbed,
                            dense=not k or int(hist.max(initial=0)) <= k),
        ])  # (6, R): attention FLOPs/head, attention bytes, indexer FLOPs, indexer bytes; where
        # prefill chunks run expanded, attention FLOPs/head of the pairs and of the expansion
        dec = rows == 1
        work = {"batch": batch, "rows": rows, "hist": hist, "per_req": per_req,
                "n": int(rows.sum()), "n_dec": int(dec.sum()),
                "pf_rows": int(rows[~dec].sum()), "pf_prefix": int(prefix[~dec].sum()),
                "total": per_req.sum(axis=1), "dec_total": per_req[:, dec].sum(axis=1)}
        if len(cache) > 16:
            cache.clear()
        cache[batch] = work
        return work

    def _expanded(self, rows: np.ndarray, prefix: np.ndarray, absorbed: np.ndarray,
                  dense: bool) -> tuple[np.ndarray, np.ndarray]:
        """Attention FLOPs per head of each request in the form the engine runs it outside DOP:
        (the pairs' part, the history's expansion) — expanded for prefill chunks where that is
        faster (a DSA step only while every history is within index_topk), at
        ``EXPANDED_SPEED``, the expansion less the W_UK / W_UV products of the rows that
        `_attention_layer`'s projections count; else (``absorbed``, 0). CP splits the pairs
        over its ranks but every rank expands the history its rows attend."""
        none = np.zeros(len(rows))
        if not dense:
            return absorbed, none
        c = self.cfg
        hist = (rows + prefix).astype(np.float64)
        absorbed_mac, expanded_mac = request_macs(c, rows.astype(np.float64), hist)
        wins = (rows > 1) & faster_expanded(absorbed_mac, expanded_mac)
        expand = c.kv_lora_rank * (c.qk_nope_head_dim + c.v_head_dim)
        pair_part = 2.0 * (expanded_mac - hist * expand) / EXPANDED_SPEED
        history = np.maximum(2.0 * (hist / EXPANDED_SPEED - rows) * expand, 0.0)
        return np.where(wins, pair_part, absorbed), np.where(wins, history, none)

    def _by_owner(self, w: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        """(work (4, T), rows (T,)) summed per owner rank; owners greedy unless given."""
        if "by_owner" not in w:
            owners = self._owners(w["batch"], w["hist"])
            onehot = np.zeros((len(owners), self.world))
            onehot[np.arange(len(owners)), owners] = 1.0
            w["by_owner"], w["own_rows"] = w["per_req"] @ onehot, w["rows"] @ onehot
        return w["by_owner"], w["own_rows"]

    def _attention_layer(self, lay: Layout, w: dict[str, Any]) -> dict[str, float]:
        """One layer's attention block: each stage costs its busiest rank."""
        c, T, H = self.cfg, self.world, self.cfg.num_attention_heads
        D, L = c.kv_lora_rank + c.qk_rope_head_dim, c.kv_lora_rank
        n = w["n"]
        by_owner, own_rows = self._by_owner(w) if lay.uses_owners else (np.zeros((6, T)),
                                                                         np.zeros(T))
        hd = H // T if lay.shards_heads else H
        bytes_row = c.hidden_size * ACT_BYTES
        comm: list[float] = []  # bytes of each collective on the busiest rank
        if lay.kv is KVPlacement.OWNED:
            per_rank = by_owner * np.array([[H], [1], [1], [1], [H], [H]])  # (6, T)
            q_rows = own_rows if not lay.shards_heads else np.full(T, float(n))
        elif lay.kv is KVPlacement.REPLICATED:
            per_rank = np.repeat((w["total"] * np.array([hd, 1, 1, 1, hd, hd]))[:, None], T,
                                 axis=1)
            q_rows = np.full(T, float(n))
        else:  # CP: decode splits positions; prefill splits query rows over a gathered prefix
            tot, dec = w["total"], w["dec_total"]
            v = np.array([tot[0] * H / T, dec[1] / T + tot[1] - dec[1], tot[2] / T,
                          dec[3] / T + tot[3] - dec[3], tot[4] * H / T, tot[5] * H])
            per_rank = np.repeat(v[:, None], T, axis=1)
            q_rows = np.full(T, float(w["n_dec"] + -(-w["pf_rows"] // T)))
        if T > 1:
            if lay.shards_heads:
                if lay.uses_owners:  # DOP: rows -> owners with H/T heads of D, back with L
                    for width in (D, L):
                        send = (n - own_rows) * hd * width * ACT_BYTES
                        recv = own_rows * (H - hd) * width * ACT_BYTES
                        comm.append(float(np.maximum(send, recv).max()))
                comm.append(2 * (T - 1) / T * n * bytes_row)  # all-reduce after O
            elif lay.uses_owners:  # DP: variable row all-gather
                comm.append(float(((n - own_rows) * bytes_row).max()))
            else:  # CP
                if w["n_dec"]:  # (o, lse) partials of every decode row from every rank
                    comm.append((T - 1) * w["n_dec"] * H * (L * ACT_BYTES + LSE_BYTES))
                if w["pf_rows"]:  # prefix latent all-gather, then output rows all-gather
                    comm.append(w["pf_prefix"] * self.kv_bytes_per_token_per_layer * (T - 1) / T)
                    comm.append(w["pf_rows"] * bytes_row * (T - 1) / T)
        gemm, wb, k = self._k["gemm_tflops"], self._k["wb"], self._k
        busy = q_rows > 0
        common_rows = q_rows if (lay.uses_owners and not lay.shards_heads) else np.full(T, n)
        common = self._roof(2 * common_rows * k["common_params"],
                            (common_rows > 0) * k["common_params"] * wb, gemm)
        proj = self._roof(2 * q_rows * hd * k["q_params_per_head"],
                          busy * hd * k["q_params_per_head"] * wb, gemm)
        proj = proj + self._roof(2 * q_rows * hd * k["o_params_per_head"],
                                 busy * hd * k["o_params_per_head"] * wb, gemm)
        dop = lay.shards_heads and lay.uses_owners  # a row's heads attend away from its owner
        flops = per_rank[0] if dop else per_rank[4] + per_rank[5]
        attn = self._roof(flops, per_rank[1], self.profile.peak_bf16_tflops)
        # fixed cost per attended row (one kernel program per request and head group): ~0 on
        # GPUs, where programs run in parallel; dominant under the Triton interpreter
        attended = own_rows if lay.kv is KVPlacement.OWNED else np.full(T, float(n))
        attn = attn + attended * self.profile.kernel_program_us * 1e-3
        if lay.shards_heads and lay.uses_owners and T > 1:  # DOP: 4 exchange-pack kernels/row
            attn = attn + 4 * n * self.profile.copy_program_us * 1e-3
        idx_tflops = self.profile.peak_fp8_tflops or self.profile.peak_bf16_tflops
        attn = attn + self._roof(per_rank[2], per_rank[3], idx_tflops)
        return {"common": float(common.max()), "proj": float(proj.max()),
                "attention": float(attn.max()), "comm_ms": self._link_ms(sum(comm)),
                "comm_bytes": sum(comm), "count": len(comm)}

    def _mlp_ms(self, n: int) -> float:
        """All layers' MLP/MoE, tensor-parallel over T ranks (identical in every layout)."""
        c, T, wb, gemm = self.cfg, self.world, self._k["wb"], self._k["gemm_tflops"]
        dense_p = 3 * c.hidden_size * c.intermediate_size / T
        total = self._num_layers_ms(self._k["num_dense_layers"], 2 * n * dense_p, dense_p * wb, gemm)
        if self._k["num_moe_layers"]:
            E, k = c.n_routed_experts, c.num_experts_per_tok
            expert_p = 3 * c.hidden_size * c.moe_intermediate_size / T
            touched = E * (1 - (1 - k / E) ** n) + (c.n_shared_experts or 0)
            fl = 2 * n * (k + (c.n_shared_experts or 0)) * expert_p + 2 * n * c.hidden_size * E
            total += self._num_layers_ms(self._k["num_moe_layers"], fl, touched * expert_p * wb,
                                         gemm)
        return total

    def _num_layers_ms(self, layers: int, flops: float, nbytes: float, tflops: float) -> float:
        return layers * float(self._roof(flops, nbytes, tflops)) if layers else 0.0

    def _lm_head_ms(self, sampled_rows: int) -> float:
        c = self.cfg
        p = c.vocab_size * c.hidden_size
        return float(self._roof(2 * sampled_rows * p, p * self._k["wb"], self._k["gemm_tflops"]))

