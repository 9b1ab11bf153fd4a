"""Fused MoE: the SwiGLU routed experts of DeepSeek MoE as two grouped GEMMs.

For token t with routing ``(topk_weights[t, j], topk_ids[t, j])``, j < k::

    out[t] = sum_j  w_j · down_e(silu(gate_e(x_t)) · up_e(x_t)),   e = topk_ids[t, j]

with ``w_gate_up[e]`` (2I, hidden) = gate rows then up rows and ``w_down[e]`` (hidden, I). I is
this rank's slice of the expert width, so on tensor-parallel ranks the result is a partial sum.

Steps (M = N·k token-expert pairs, pair p = t·k + j):

1. ``moe_align`` (``moe_align.py``): sort the pairs by expert and pad each expert's run to a
   multiple of BLOCK_M, so every BLOCK_M block of the sorted list belongs to one expert.
2. gate_up GEMM: block b multiplies the rows x[p // k] of its pairs by expert e's gate and up
   tiles (two accumulators) and stores silu(gate)·up, rounded to x's dtype, in row order of
   the sorted list: ``inter`` (sorted slots, I). Padding slots' rows stay unwritten: a row of
   a product depends only on that row of its input, and padding results are never stored.
3. down GEMM: the same blocks multiply their rows of inter, read in order, by w_down[e]ᵀ, scale
   row p by its routing weight and store at row p of ``partial`` (M, hidden).
4. ``slot_sum`` adds the k slots of each token (fp32 accumulation, one Triton kernel).

Tiles are swizzled in groups of GROUP_M row blocks so consecutive programs share weight tiles in
L2. Both GEMMs use the one BLOCK_M of the alignment; the other tile sizes may differ per GEMM.
With ``"tma"`` in the config (CUDA sm_90+, aligned tensors) the weight tiles, and the down
GEMM's rows of inter, arrive through tensor descriptors (the Tensor Memory Accelerator) instead
of per-thread loads; rows and columns past a tensor's end read as 0. x's rows are a gather by
pair, so they keep pointer loads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from splash.backends import device_tuning
from splash.kernels_triton import _validate as V
from splash.kernels_triton.moe_align import moe_align


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])  # ints that vary by step: one binary for all
def _moe_gemm_kernel(
    a_ptr,  # (rows, K): x (rows = tokens) for gate_up, inter (rows = sorted slots) for down
    w_ptr,  # (E, N_w, K): N_w = 2·N_out when GATED (gate rows, then up rows), else N_out
    c_ptr,  # (rows, N_out): row = sorted slot when C_SORTED, else row p = pair p
    sorted_ids_ptr,  # (num_blocks·BLOCK_M,) int32 pair ids sorted by expert, sentinel M
    block_expert_ptr,  # (num_blocks,) int32 expert of each row block, -1 past the end
    topk_weights_ptr,  # (M,) fp32, read when not GATED
    num_pairs,  # M
    a_row_div,  # a row of pair p is p // a_row_div (k for gate_up, 1 for down)
    N_out,
    K,
    num_blocks,
    stride_am, stride_ak,
    stride_we, stride_wn, stride_wk,
    stride_cm, stride_cn,
    GATED: tl.constexpr,  # True: c = silu(a·gateᵀ)·(a·upᵀ); False: c = weight · (a·wᵀ)
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K masks
    A_SORTED: tl.constexpr,  # a's rows are in sorted order (row = sorted position), else pairs
    C_SORTED: tl.constexpr,  # store row p of c at its sorted position, else at row p
    TMA: tl.constexpr,  # w_ptr (and a_ptr when A_SORTED) are tensor descriptors
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # grouped tile order: GROUP_M row blocks sweep the N tiles together (weight reuse in L2)
    pid = tl.program_id(0)
    num_n = tl.cdiv(N_out, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m

    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + offs_m)  # (BLOCK_M,)
    row_ok = pairs < num_pairs
    if A_SORTED:
        a_rows = offs_m.to(tl.int64)
    else:
        a_rows = (pairs // a_row_div).to(tl.int64)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_wn = offs_n % N_out  # wrapped columns are computed but never stored
    offs_k = tl.arange(0, BLOCK_K)

    A_DESC: tl.constexpr = TMA and A_SORTED
    if not A_DESC:
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak  # (BM, BK)
    if not TMA:
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        b_ptrs = w_base + offs_wn[None, :] * stride_wn + offs_k[:, None] * stride_wk  # (BK, BN)
        u_ptrs = b_ptrs + N_out * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k0 = kb * BLOCK_K
        k_ok = offs_k < K - k0
        if A_DESC:
            a = a_ptr.load([pid_m * BLOCK_M, k0])  # columns past K read as 0
        else:
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            a_ptrs += BLOCK_K * stride_ak
        if TMA:  # (1, BN, BK) tiles of expert e's rows; rows and columns past the end read as 0
            b = tl.trans(w_ptr.load([expert, n0, k0]).reshape(BLOCK_N, BLOCK_K))
        else:
            if EVEN_K:
                b = tl.load(b_ptrs)
            else:
                b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
            b_ptrs += BLOCK_K * stride_wk
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
        if GATED:
            if TMA:
                u = tl.trans(w_ptr.load([expert, N_out + n0, k0]).reshape(BLOCK_N, BLOCK_K))
            else:
                if EVEN_K:
                    u = tl.load(u_ptrs)
                else:
                    u = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
                u_ptrs += BLOCK_K * stride_wk
            acc_up += tl.dot(a, u, input_precision=DOT_PRECISION)

    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up  # silu(gate) · up, in fp32
    else:
        weight = tl.load(topk_weights_ptr + pairs, mask=row_ok, other=0.0)
        acc = acc * weight[:, None]
    col_ok = (offs_n < N_out)[None, :]
    if C_SORTED:
        c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok)
    else:
        c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok)


# ---------------------------------------------------------------------------------------------
# launchers

# fp32 activations on a GPU (the GPU test suite's exact-token runs): the bf16-tuned tiles would
# overflow shared memory at twice the bytes, so smaller tiles override any config
_GPU_FP32: dict[str, Any] = {
    "BLOCK_M": 32, "BLOCK_K": 32, "num_warps": 4,
    "gate_up": {"BLOCK_N": 64, "num_stages": 2}, "down": {"BLOCK_N": 64, "num_stages": 2},
}
_TILE_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")
_GEMMS = ("gate_up", "down")


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = {**base.get(key, {}), **value} if key in _GEMMS else value
    return out


def _for_tokens(cfg: dict[str, Any], tokens: int | None) -> dict[str, Any]:
    """``cfg`` with its "by_tokens" entry resolved for a batch of ``tokens``."""
    cfg = dict(cfg)
    for max_tokens, over in cfg.pop("by_tokens", []):
        if tokens is not None and tokens <= max_tokens:
            return _merge(cfg, over)
    return cfg


def _gemm_configs(config: dict | None, device: torch.device, fp32: bool = False,
                  tokens: int | None = None) -> dict[str, dict[str, Any]]:
    """Per-GEMM launch parameters: the device's backend table (``device_tuning``; top-level
    keys apply to both GEMMs, "gate_up" / "down" override per GEMM, BLOCK_M is shared: the
    alignment of the sorted pairs; "by_tokens": ``[[max_tokens, overrides], ...]``, the first
    entry whose ``max_tokens`` covers ``tokens`` applies, for decode-sized batches), then
    ``config``, then the fp32 tiles for fp32 activations on a GPU."""
    cfg = _merge(_for_tokens(device_tuning(device, "fused_moe"), tokens),
                 _for_tokens(config or {}, tokens))
    if fp32 and device.type == "cuda":
        cfg = _merge(cfg, _GPU_FP32)
    unknown = set(cfg) - {*_TILE_KEYS, "num_warps", "num_stages", "tma", *_GEMMS}
    if unknown:
        raise ValueError(f"config has unknown keys {sorted(unknown)}")
    out = {}
    for gemm in _GEMMS:
        one = {k: v for k, v in cfg.items() if k not in _GEMMS}
        one.update(cfg.get(gemm, {}))
        if "BLOCK_M" in cfg.get(gemm, {}):
            raise ValueError(f"config[{gemm!r}] may not set BLOCK_M (shared by both GEMMs)")
        for key in _TILE_KEYS:
            v = one.get(key)
            if not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"config {gemm} {key}={v!r} must be a power of two")
        if min(one["BLOCK_M"], one["BLOCK_N"], one["BLOCK_K"]) < 16:
            raise ValueError(f"config {gemm}: BLOCK_M, BLOCK_N, BLOCK_K must be >= 16 (tl.dot)")
        out[gemm] = one
    return out


@triton.jit
def _slot_sum_kernel(p_ptr, add_ptr, out_ptr, hidden, K_SLOTS: tl.constexpr,
                     HAS_ADD: tl.constexpr, BLOCK: tl.constexpr):
    """out[t] = sum_j partial[t·k + j] in fp32 (one program per token and BLOCK columns), then
    with HAS_ADD rounded and added to add[t] as torch adds two tensors of out's dtype."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < hidden
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in range(K_SLOTS):
        acc += tl.load(p_ptr + (t * K_SLOTS + j) * hidden + offs, mask=ok, other=0.0).to(tl.float32)
    out = acc.to(out_ptr.dtype.element_ty)
    if HAS_ADD:
        extra = tl.load(add_ptr + t * hidden + offs, mask=ok, other=0.0)
        out = (out.to(tl.float32) + extra.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * hidden + offs, out, mask=ok)


def slot_sum(partial: torch.Tensor, k: int, add: torch.Tensor | None = None) -> torch.Tensor:
    """(N·k, hidden) -> (N, hidden): the k slots of each token added in fp32, rounded, then
    ``add`` (N, hidden) added (exactly ``slot_sum(partial, k) + add``, one kernel)."""
    N, hidden = partial.shape[0] // k, partial.shape[1]
    out = torch.empty((N, hidden), dtype=partial.dtype, device=partial.device)
    if add is not None:
        V.check_tensor("add", add, 2, (partial.dtype,), partial.device)
        if tuple(add.shape) != (N, hidden) or not add.is_contiguous():
            raise ValueError(f"add must be a contiguous {(N, hidden)}; got {tuple(add.shape)}")
    if N:
        block = 1024 if partial.is_cuda else 64
        _slot_sum_kernel[(N, triton.cdiv(hidden, block))](
            partial, add if add is not None else out, out, hidden, K_SLOTS=k,
            HAS_ADD=add is not None, BLOCK=block)
    return out


def _tma_ok(cfg: dict[str, Any], *tensors: torch.Tensor) -> bool:
    """Whether the GEMM reads its tiles through tensor descriptors: asked for (``"tma"``), a GPU
    with the Tensor Memory Accelerator (CUDA sm_90+; the interpreter emulates it) and tensors
    whose base and row strides are 16-byte aligned, as a descriptor needs."""
    if not cfg.get("tma"):
        return False
    dev = tensors[0].device
    if dev.type == "cuda":
        if torch.version.hip is not None or torch.cuda.get_device_capability(dev) < (9, 0):
            return False
    elif not V.interpreting():
        return False
    return all(t.data_ptr() % 16 == 0 and all(st * t.element_size() % 16 == 0 for st in t.stride()[:-1])
               for t in tensors)


def _launch_gemm(a, w, c, sorted_ids, block_expert, topk_weights, num_pairs, a_row_div,
                 n_out, k_dim, gated, cfg) -> None:
    """One grouped GEMM. gate_up (``gated``) gathers x's rows by pair and stores each result at
    its sorted position; down reads those rows in order and stores by pair."""
    num_blocks = block_expert.shape[0]
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    grid = (num_blocks * triton.cdiv(n_out, bn),)
    a_sorted = not gated
    sorted_buf = a if a_sorted else c  # inter: one row per slot of the sorted list
    if sorted_buf.shape[0] < sorted_ids.shape[0]:
        raise ValueError(f"inter has {sorted_buf.shape[0]} rows; the sorted list needs one per "
                         f"slot ({sorted_ids.shape[0]})")
    tma = _tma_ok(cfg, a, w)
    a_arg, w_arg = a, w
    if tma:
        w_arg = TensorDescriptor.from_tensor(w, [1, bn, bk])
        if a_sorted:
            a_arg = TensorDescriptor.from_tensor(a, [bm, bk])
    _moe_gemm_kernel[grid](
        a_arg, w_arg, c, sorted_ids, block_expert, topk_weights, num_pairs, a_row_div, n_out,
        k_dim, num_blocks, a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2),
        c.stride(0), c.stride(1),
        GATED=gated, EVEN_K=k_dim % bk == 0, A_SORTED=a_sorted, C_SORTED=gated, TMA=tma,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"],
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def _check_inputs(x, w_gate_up, w_down, topk_weights, topk_ids) -> None:
    V.check_tensor("x", x, 2, V.FLOAT_DTYPES)
    dev, dtype = x.device, x.dtype
    V.check_tensor("w_gate_up", w_gate_up, 3, (dtype,), dev)
    V.check_tensor("w_down", w_down, 3, (dtype,), dev)
    V.check_tensor("topk_weights", topk_weights, 2, (torch.float32,), dev)
    V.check_tensor("topk_ids", topk_ids, 2, V.INDEX_DTYPES, dev)
    N, hidden = x.shape
    E, two_i, _ = w_gate_up.shape
    if two_i == 0 or two_i % 2:
        raise ValueError(f"w_gate_up has {two_i} rows per expert; expected 2·I > 0 (gate, up)")
    I = two_i // 2
    V.check_dim("w_gate_up", w_gate_up, 2, hidden, "hidden size of x")
    if tuple(w_down.shape) != (E, hidden, I):
        raise ValueError(f"w_down has shape {tuple(w_down.shape)}; expected {(E, hidden, I)} "
                         "(experts, hidden, I) to match w_gate_up and x")
    if topk_ids.shape[0] != N or topk_ids.shape[1] == 0:
        raise ValueError(f"topk_ids has shape {tuple(topk_ids.shape)}; expected ({N}, k >= 1)")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_weights has shape {tuple(topk_weights.shape)}; expected "
                         f"{tuple(topk_ids.shape)} like topk_ids")
    for name, t in (("x", x), ("w_gate_up", w_gate_up), ("w_down", w_down)):
        V.check_unit_stride(name, t)
    V.check_index_range("topk_ids", topk_ids, E, allow_neg1=False)


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: dict | None = None,
    add: Callable[[], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Routed SwiGLU experts: x (N, hidden), w_gate_up (E, 2I, hidden) gate rows then up rows,
    w_down (E, hidden, I), topk_weights (N, k) fp32, topk_ids (N, k) int in [0, E) ->
    (N, hidden) in x's dtype: sum_j topk_weights[:, j] · down_e(silu(gate_e(x)) · up_e(x)),
    plus ``add()`` (N, hidden) in the final sum's kernel when given (the shared experts'
    output: called just before that kernel, so it may join work that ran beside this)."""
    _check_inputs(x, w_gate_up, w_down, topk_weights, topk_ids)
    N, hidden = x.shape
    E, I, k = w_gate_up.shape[0], w_down.shape[2], topk_ids.shape[1]
    if N == 0:
        return torch.zeros_like(x) if add is None else add().clone()
    cfgs = _gemm_configs(config, x.device, fp32=x.dtype == torch.float32, tokens=N)
    M = N * k
    sorted_ids, block_expert = moe_align(topk_ids, E, cfgs["gate_up"]["BLOCK_M"])
    weights = topk_weights.contiguous().reshape(-1)  # (M,)
    inter = torch.empty((sorted_ids.shape[0], I), dtype=x.dtype, device=x.device)  # sorted rows
    partial = torch.empty((M, hidden), dtype=x.dtype, device=x.device)
    _launch_gemm(x, w_gate_up, inter, sorted_ids, block_expert, weights, M, k, I, hidden, True,
                 cfgs["gate_up"])
    _launch_gemm(inter, w_down, partial, sorted_ids, block_expert, weights, M, 1, hidden, I,
                 False, cfgs["down"])
    return slot_sum(partial, k, add() if add is not None else None)  # (N, hidden)


def fused_moe_ref(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Torch reference of ``fused_moe``: a loop over the experts, in fp32, cast to x's dtype."""
    I = w_down.shape[2]
    xf = x.float()
    out = torch.zeros_like(xf)
    for expert in torch.unique(topk_ids).tolist():
        rows, slot = (topk_ids == expert).nonzero(as_tuple=True)
        gu = xf[rows] @ w_gate_up[expert].float().t()  # (n_e, 2I)
        y = (torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]) @ w_down[expert].float().t()
        out.index_add_(0, rows, y * topk_weights[rows, slot, None].float())
    return out.to(x.dtype)
