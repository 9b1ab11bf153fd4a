"""Tensor-parallel SwiGLU MLP and DeepSeek MoE (routed + shared experts).

Every rank holds a contiguous slice of the intermediate dimension of the dense MLP, of each
routed expert and of the shared experts (`shard_range`; uneven sizes allowed). `forward`
returns a partial (N, hidden) sum; summing the partials of all ranks (the caller's
all-reduce) gives the full output. The router runs replicated, in fp32, on every rank.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from splash.kernels_triton import fused_moe, moe_route, moe_route_ref
from splash.model import overlap
from splash.model.config import ModelConfig
from splash.model.loader import take

_EXPERT = re.compile(r"experts\.(\d+)\.(gate|up|down)_proj\.weight")


def shard_range(n: int, rank: int, world: int) -> tuple[int, int]:
    """[start, end) of rank's contiguous share of n items (sizes differ by at most one)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world of {world}")
    base, rem = divmod(n, world)
    start = rank * base + min(rank, rem)
    return start, start + base + (1 if rank < rem else 0)


def _prep(t: torch.Tensor, dtype: torch.dtype | None, device: torch.device | str | None) -> torch.Tensor:
    return t.to(device=device, dtype=dtype or t.dtype).contiguous()


class DenseMLP:
    """down(silu(gate(x)) * up(x)) over this rank's intermediate slice; returns a partial sum."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                 shard: tuple[int, int] | None = None) -> None:
        self.size = gate.shape[0]
        self.gate_up = torch.cat((gate, up), dim=0)  # (2i, hidden)
        self.down = down  # (hidden, i)
        self.shard = shard or (0, self.size)  # [start, end) of the intermediate dim held

    @classmethod
    def from_weights(cls, weights: Mapping[str, torch.Tensor], prefix: str, intermediate: int,
                     rank: int = 0, world: int = 1, dtype: torch.dtype | None = None,
                     device: torch.device | str | None = None) -> DenseMLP:
        s, e = shard_range(intermediate, rank, world)
        return cls(_prep(take(weights, prefix + "gate_proj.weight", 0, s, e), dtype, device),
                   _prep(take(weights, prefix + "up_proj.weight", 0, s, e), dtype, device),
                   _prep(take(weights, prefix + "down_proj.weight", 1, s, e), dtype, device),
                   (s, e))

    def load_weight(self, weights: Mapping[str, torch.Tensor], name: str, prefix: str) -> bool:
        """Copy the new value of HF tensor ``prefix + name`` into this rank's slice, in place."""
        s, e = self.shard
        if name == "down_proj.weight":
            self.down.copy_(take(weights, prefix + name, 1, s, e))
        elif name in ("gate_proj.weight", "up_proj.weight"):
            half = slice(0, self.size) if name.startswith("gate") else slice(self.size, None)
            self.gate_up[half].copy_(take(weights, prefix + name, 0, s, e))
        else:
            return False
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = x @ self.gate_up.t()  # (N, 2i)
        return (F.silu(gu[:, :self.size]) * gu[:, self.size:]) @ self.down.t()  # (N, hidden)

    __call__ = forward


def select_experts(logits: torch.Tensor, cfg: ModelConfig,
                   bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits (N, E) fp32 -> (weights (N, k) fp32, expert ids (N, k) int64).

    deepseek_v2: softmax scores; greedy, or group-limited with group score = max (masked to 0).
    noaux_tc (v3 family): sigmoid scores; choice = score + correction bias; groups scored by
    the sum of their top-2 choices (masked to -inf); weights are the unbiased scores. One
    Triton kernel on CUDA, torch elsewhere (`splash.kernels_triton.moe_route`).
    """
    route = moe_route if _kernel(logits) else moe_route_ref
    return route(logits, bias, cfg.scoring_func, cfg.topk_method, cfg.n_group, cfg.topk_group,
                 cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.routed_scaling_factor)


def _kernel(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.version.hip is None


def routed_experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                         weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The routed experts as a torch loop over the experts hit (the CPU path; reference of
    `fused_moe`): x (N, hidden), w13 (E, 2i, hidden), w2 (E, hidden, i) -> (N, hidden)."""
    size = w2.shape[2]
    out = torch.zeros_like(x)
    for expert in torch.unique(ids).tolist():
        rows, slot = (ids == expert).nonzero(as_tuple=True)
        gu = x[rows] @ w13[expert].t()  # (n_e, 2i)
        y = (F.silu(gu[:, :size]) * gu[:, size:]) @ w2[expert].t()  # (n_e, hidden)
        out.index_add_(0, rows, (y.float() * weights[rows, slot, None]).to(out.dtype))
    return out


class MoE:
    """Routed experts (this rank's intermediate slice of each) plus optional shared experts.

    The expert weights are stacked once at load, (E, 2i, hidden) and (E, hidden, i), the layout
    the fused Triton kernel reads on CUDA; elsewhere a torch loop over the experts runs.
    `kernel_config` (the backend's "fused_moe" tuning entry) sets the kernel's launch parameters.
    """

    def __init__(self, cfg: ModelConfig, router: torch.Tensor, bias: torch.Tensor | None,
                 w13: torch.Tensor, w2: torch.Tensor, shared: DenseMLP | None,
                 shard: tuple[int, int] | None = None) -> None:
        self.cfg = cfg
        self.router = router.float()  # (E, hidden)
        self.bias = None if bias is None else bias.float()  # (E,)
        self.w13 = w13  # (E, 2i, hidden): gate rows then up rows
        self.w2 = w2  # (E, hidden, i)
        self.size = w2.shape[2]
        self.shared = shared
        self.shard = shard or (0, self.size)  # [start, end) of each expert's intermediate dim
        self.kernel_config: dict | None = None

    @classmethod
    def from_weights(cls, cfg: ModelConfig, weights: Mapping[str, torch.Tensor], prefix: str,
                     rank: int = 0, world: int = 1, dtype: torch.dtype | None = None,
                     device: torch.device | str | None = None) -> MoE:
        """Build from HF names under `prefix` (e.g. `model.layers.3.mlp.`): per-expert
        `experts.{e}.{gate,up,down}_proj.weight` or fused `experts.gate_up_proj` / `down_proj`."""
        size = cfg.moe_intermediate_size
        s, e = shard_range(size, rank, world)
        if prefix + "experts.gate_up_proj" in weights:
            gu = take(weights, prefix + "experts.gate_up_proj")  # (E, 2I, hidden)
            w13 = torch.cat((gu[:, s:e], gu[:, size + s:size + e]), dim=1)
            w2 = take(weights, prefix + "experts.down_proj")[:, :, s:e]  # (E, hidden, i)
        else:
            def one(x: int, proj: str, dim: int) -> torch.Tensor:
                return take(weights, f"{prefix}experts.{x}.{proj}_proj.weight", dim, s, e)

            w13 = torch.stack([torch.cat((one(x, "gate", 0), one(x, "up", 0)), dim=0)
                               for x in range(cfg.n_routed_experts)])
            w2 = torch.stack([one(x, "down", 1) for x in range(cfg.n_routed_experts)])
        bias = None
        if cfg.topk_method == "noaux_tc":
            bias = take(weights, prefix + "gate.e_score_correction_bias").to(device)
        shared = None
        if cfg.n_shared_experts:
            shared = DenseMLP.from_weights(weights, prefix + "shared_experts.",
                                           size * cfg.n_shared_experts, rank, world, dtype, device)
        router = take(weights, prefix + "gate.weight").to(device)
        return cls(cfg, router, bias, _prep(w13, dtype, device), _prep(w2, dtype, device), shared,
                   (s, e))

    def load_weight(self, weights: Mapping[str, torch.Tensor], name: str, prefix: str) -> bool:
        """Copy the new value of HF tensor ``prefix + name`` into this rank's slice, in place."""
        s, e = self.shard
        size, full = self.size, self.cfg.moe_intermediate_size
        if name == "gate.weight":
            self.router.copy_(take(weights, prefix + name))
        elif name == "gate.e_score_correction_bias" and self.bias is not None:
            self.bias.copy_(take(weights, prefix + name))
        elif name.startswith("shared_experts.") and self.shared is not None:
            return self.shared.load_weight(weights, name.removeprefix("shared_experts."),
                                           prefix + "shared_experts.")
        elif name == "experts.gate_up_proj":
            gu = take(weights, prefix + name)  # (E, 2I, hidden)
            self.w13.copy_(torch.cat((gu[:, s:e], gu[:, full + s:full + e]), dim=1))
        elif name == "experts.down_proj":
            self.w2.copy_(take(weights, prefix + name)[:, :, s:e])
        elif (m := _EXPERT.fullmatch(name)) is not None:
            x, proj = int(m.group(1)), m.group(2)
            t = take(weights, prefix + name, 1 if proj == "down" else 0, s, e)
            if proj == "down":
                self.w2[x].copy_(t)
            elif proj == "gate":
                self.w13[x, :size].copy_(t)
            else:
                self.w13[x, size:].copy_(t)
        else:
            return False
        return True

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, hidden) -> (weights (N, k) fp32, ids (N, k)); identical on every rank."""
        return select_experts(x.float() @ self.router.t(), self.cfg, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared
        # the shared experts run beside the router and the routed experts (on a second CUDA
        # stream unless SPLASH_OVERLAP=0) and are added in the routed experts' final sum
        pending = overlap.start(lambda: shared(x)) if shared is not None else None
        weights, ids = self.route(x)
        if x.is_cuda and torch.version.hip is None:
            return fused_moe(x, self.w13, self.w2, weights, ids, self.kernel_config,
                             add=pending.result if pending is not None else None)
        out = routed_experts_torch(x, self.w13, self.w2, weights, ids)
        return out if pending is None else out + pending.result()

    __call__ = forward
