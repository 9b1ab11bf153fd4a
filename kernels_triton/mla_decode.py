"""Absorbed MLA decode over a paged latent KV cache (split-KV, many heads per program).

One query row per request: ``q`` (N, H, D) holds, per head, ``q_nope @ W_UK`` (L dims) followed
by the roped ``q_rope`` (R dims). Every head attends the same latent rows of its request, taken
page by page through ``block_table``: score = q · row (all D dims), value = row[:L]. So

    out[n, h] = softmax_t(sm_scale * q[n, h] · kv[t]) @ kv[t, :L],   lse = log sum_t exp(...)

Design:
- A program owns a *head group* of ``BLOCK_H`` heads (up to 64) of one request and one KV split,
  so each KV tile is loaded once per head group and both products are tensor-core ``tl.dot``s:
  scores (BLOCK_H, BLOCK_N) = q_nope·kv_nopeᵀ + q_rope·kv_ropeᵀ, acc (BLOCK_H, L) += p·kv_nope.
  The peer kernel re-reads every tile for each 16 heads; with 128 heads that is 8 reads.
- Split-KV: ``num_splits`` programs share a request's tokens (tile-aligned ranges); each writes a
  normalised fp32 partial and its lse, and ``lse_merge``'s kernel combines them. With one split the
  program writes the final output directly. ``config["low_partials"]`` (CUDA: 8): a request
  of at most that many splits writes its partials in a 16-bit output's own dtype instead
  (True: every request), into rows of their own beside the fp32 ones; the merge reads each
  request's from where its split count says. Half the partials' traffic: on an H200, 16
  heads, a layer at 64 x 4K 1.1% faster, 64 x 1K 4.2%, 128 heads 8 x 4K 10%; every request
  in 16-bit made one 128K request among 63 of 1K 12% slower (its merge of many partials)
  and 16 heads 8 x 4K, 16 splits each, 5% (``decode_low_partials.json``).
  Head groups of a (request, split) sit next to each other in the grid, so they run together
  and share tiles through L2.
- Balanced splits (``config["balanced"]``, the CUDA default): the split counts follow the
  batch's total work instead of one count for every request. A one-launch plan
  (``_decode_plan_kernel``, from ``seq_lens`` on the device: no host sync, graph-safe) gives each
  program its request and token range: a split holds at most W tiles (at least
  min_split_tokens / BLOCK_N), the fewest for which the requests' splits, ceil(tiles / W)
  each, fill at most P programs, P being those a head group may fill (``programs_per_sm`` x
  SMs / head groups); so a long request gets many splits and a short one a single program
  that writes the output itself; the merge combines each request's run of partial rows. (W
  was first the bound ceil(T / (P - N)) for T tiles over N requests, which left half the
  programs idle when N neared P / 2: 16 heads, 128 x 1K, 128 programs of 264; filled, 0.0625
  -> 0.0505 ms a layer, ``decode_plan_fill.json``.) H200, graph-timed, against one count for
  all (the wave model below, ``balanced: False``): 16 heads, one 128K request among 63 of 1K 1.72 -> 0.104 ms, four of 64K
  among 60 of 512 0.87 -> 0.13 ms, 64 requests spread over 1K-32K 0.532 -> 0.447 ms; 128 heads,
  one 128K among 15 of 2K 0.298 -> 0.213 ms, 16 over 1K-32K 0.498 -> 0.354 ms; uniform batches,
  which get the same splits, 2-5% slower (the plan launch, the merge's ranges, and an attention
  kernel 2.5% slower at 64 x 32K for reasons not found). Tried: the merge inside the attention
  kernel (the last split of a request, found by an arrival counter, merged the partials):
  slower at every shape, and 2.8x slower with one long request among short ones, whose many
  partials one program then merged alone.
- Otherwise (``balanced: False`` or an explicit ``num_splits``) every request
  gets the split count of ``choose_num_splits``' wave model, from the block-table capacity.
- L and R need not be powers of two: tiles are padded to ``BLOCK_L``/``BLOCK_R`` and masked.
- fp8 KV: a row is fp8 × one fp32 scale. The tile is widened exactly (fp8 values are fp16 and
  bf16 values), the scale multiplies the scores' column and p's column, so no per-element scaling
  is needed. ``config["fp8_fp16"]`` (the CUDA default) runs both products on fp16 operands: q is
  clamped to [-65504, 65504] and cast to fp16 once per program, the fp8 tiles widen to fp16 and
  p is rounded to fp16; accumulators stay fp32 and the output keeps q's dtype. fp8 -> fp16 is a
  native conversion on Hopper (fp8 -> bf16 is emulated: the bf16-product kernel read an fp8 cache
  2.6x slower than a bf16 one). A query entry beyond fp16's range saturates at ±65504 rather than
  overflowing to inf / NaN; the references dequantise the same fp8 values with the unclamped q.
  Without it (CPU default) the tile is widened to q's dtype. The Hopper Gluon kernels
  (``config["fp8_query"]``, the CUDA default) read q in e4m3 too, with a scale a head, for
  an fp8 scores' product: 2.1x faster at 128 heads, 2.3x at 16 (the value operand widened
  in registers at 16 heads, ``mla_decode_tokens_fp8``; by a warpgroup of its own at 128,
  ``mla_decode_heads_fp8_ws``), at e4m3's
  rounding of q (``query_as_read`` gives the q they read; ``fp8_query: False`` keeps fp16
  products). With fp16 products on an
  NVIDIA GPU of sm_89 or newer (``config["fp8_ptx"]``, default on there) the e4m3 tile widens
  once, through PTX's conversion, before both products (``_widen_kv``): 16 heads, 64 x 32K
  13% faster than the cast that the compiler repeats in each product's operand layout.
- Tokens on M in Triton (scoresᵀ = kv·qᵀ, accᵀ += kv_nopeᵀ·pᵀ, so a 64-token tile fills a
  Hopper MMA with only 16 heads) read 16 heads at 76-78% of the copy bandwidth on an H200
  against 94% for the head-group kernel with 64-token tiles and 3 stages, and its value
  product from shared memory came out wrong on bf16 under Triton 3.6: removed (session 36).
  The Gluon tokens kernels put the tokens on M with TMA stages instead.
- Dimension chunks (``config["dim_chunks"]``, the CUDA default for few heads): a second form of
  the head-group kernel (``mla_decode_chunked.py``) splits the latent dims into four column
  chunks, each feeding both products, and re-reads the query every tile instead of holding it
  in every warp: no spills against 600 B (offline sm_90, fp8 KV, 16 heads). On an H200, 16
  heads: bf16 7-12% faster, fp8 4-7%. It applies to latents of at least 64 columns (narrower
  ones take the unchunked kernel).
  ``config["maxnreg"]`` passes ptxas a register cap (CUDA only): 168 would allow three
  programs an SM but spills and lost 8-13%. With fp8 KV the widened chunks stay live from the
  score product to the value product; widening the stored fp8 chunk again there, or
  reloading it, kept 255 registers and ran slower (16 heads, 64 x 32K 0.801 -> 1.05 / 1.17
  ms; ``decode_fp8_pv.json``).
- Gathered page ids (``config["gather_pages"]``, both heads-on-M kernels; the CUDA default
  for fp8 KV at few heads): the loop's page-table load, which each tile's addresses wait on,
  keeps Triton's software pipeliner (3.6) from running copies ahead: offline sm_90 every
  iteration starts by waiting for all of them, at any ``num_stages``. With it a split walks
  blocks of pages (True: about 4K tokens; or an int, the pages a block), loads each block's ids
  once and gathers each tile's from registers (``tl.gather``); the inner loop then keeps the
  next tile's copies in flight (chunked kernel, 16 heads: bf16 198 registers against 206, fp8
  234 against 238; the head-group kernel only from 3 stages, which at 64 heads fit shared
  memory with 32-token tiles). On an H200, 16 heads: fp8 (64-token tiles) 3-10% faster; bf16
  23% faster at 128 x 1K but 8% slower at 32K-128K; 128 heads 4-32% slower. Which way bf16
  goes follows the programs an SM, not the lengths (8 layers a graph: 128 x 1K, 128
  programs, 0.0636 -> 0.0477 ms gathered; 64 x 1K and 64 x 4K, 192 and 256 programs, 0.0338
  -> 0.0415 and 0.0848 -> 0.0924). Tried: both loops in one kernel, each program choosing
  from the plan's total (gathered while the programs fit one an SM): the per-tile loop of that
  kernel ran 25-33% slower at 64 x 4K-32K whichever way the branch was written, so a kernel
  holds one loop (``benchmarks/results/h200/decode_gather_choice.json``).
- Gluon kernels on Hopper (``config["gluon"]``, the CUDA default on sm_90, balanced plan
  only; ``gluon_programs_per_sm`` their occupancy): at many heads
  (``mla_decode_heads_gluon.py``, 16-bit KV) two warpgroups hold 64 heads, the query
  and two KV tiles come in by TMA and both products are warpgroup MMAs (128 heads bf16
  407-439 TFLOP/s a layer, 1.5x the Triton kernel; e4m3 KV: ``mla_decode_heads_fp8_ws.py``,
  the two warpgroups multiply while a third widens the value columns and issues the copies,
  1.11-1.19x bf16's tokens a second on an H100); at few heads (``mla_decode_tokens_gluon.py``) the
  tokens sit on the MMA's M side, 16-bit tiles by TMA (16 heads bf16 64 x 4K 88-90% of copy
  a layer);
  e4m3 tiles by TMA too, read as they landed by the scores' product and widened in
  registers for the values' (``mla_decode_tokens_fp8.py``, 16 heads: 1.51 / 1.77 / 1.72x
  bf16's tokens a second at 64 x 4K / 64 x 32K / 16 x 128K). The Gluon kernels read the
  16-bit q as given (the fp8 forms quantise it themselves); the Triton kernels serve
  everything else. References: ``mla_decode_ref.py``.
- Full tiles load without a token mask; only a split's last partial tile is masked. When the
  page size is a multiple of ``BLOCK_N`` a tile lies in one page and its page id is one load.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton

from splash.backends import device_tuning
from splash.kernels_triton import _validate as V
from splash.kernels_triton import mla_decode_heads_fp8_ws as heads_fp8_ws
from splash.kernels_triton import mla_decode_heads_gluon as heads_gluon
from splash.kernels_triton import mla_decode_tokens_fp8 as tokens_fp8
from splash.kernels_triton import mla_decode_tokens_gluon as tokens_gluon
from splash.kernels_triton.kv_cache_ops import quantise_rows
from splash.kernels_triton.lse_merge import _merge_into
from splash.kernels_triton.mla_decode_chunked import CHUNKS, _mla_decode_chunked_kernel
from splash.kernels_triton.mla_decode_kernels import _LOG2E, _MAX_SPLITS, _mla_decode_kernel
from splash.kernels_triton.mla_decode_plan import _decode_plan_kernel, planned
from splash.kernels_triton.pdl import pdl

# fp32 queries on a GPU (the GPU test suite's exact-token runs): tiles twice as wide in bytes,
# so small tiles and one stage keep shared memory under the limit
_GPU_FP32: dict[str, Any] = {"BLOCK_H": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}


def decode_config(
    num_heads: int, device: torch.device, config: dict | None, fp8: bool = False,
    fp32_q: bool = False,
) -> dict[str, Any]:
    """Launch parameters: the device's backend table (``device_tuning``), then ``config`` (the
    engine passes its backend's entry for the profile), then the fp32 tiles for fp32 queries on
    a GPU. In each, a ``many_heads`` sub-dict applies when H > 32 and an ``fp8`` sub-dict (which
    may hold its own ``many_heads``) when the KV cache is fp8. Fills BLOCK_H (power of two >= 16,
    at most ``max_block_h``). ``fp8_fp16`` (fp8 KV only) runs the products on fp16 operands."""
    cfg: dict[str, Any] = {}

    def apply(layer: dict[str, Any], nested: bool) -> None:
        cfg.update({k: v for k, v in layer.items() if k not in ("many_heads", "fp8")})
        if num_heads > 32:
            cfg.update(layer.get("many_heads", {}))
        if nested and fp8 and "fp8" in layer:
            apply(layer["fp8"], nested=False)

    apply(device_tuning(device, "mla_decode"), nested=True)
    apply(config or {}, nested=True)
    if fp32_q and device.type == "cuda":
        cfg.update(_GPU_FP32)  # after any config: bf16-tuned tiles overflow shared memory
    if "BLOCK_H" not in cfg:
        cfg["BLOCK_H"] = min(int(cfg["max_block_h"]), V.next_pow2(num_heads, 16))
    if cfg.get("warp_specialize"):
        # measured on an H200 (Triton 3.6): no gain at 16 or 128 heads, bf16 or fp8, and the
        # one sequence that faulted with an illegal address ran it; the option is gone
        raise ValueError("config warp_specialize is not supported by mla_decode")
    for key in ("BLOCK_H", "BLOCK_N"):
        value = cfg[key]
        if not isinstance(value, int) or value < 16 or value & (value - 1):
            raise ValueError(f"config {key}={value!r} must be a power of two >= 16")
    return cfg


def choose_num_splits(
    batch: int, head_groups: int, max_len: int, device: torch.device, cfg: dict[str, Any]
) -> int:
    """The split count that minimises estimated time = waves × (tokens per split + a fixed
    per-program cost), with ``programs_per_sm`` resident programs per SM and at least
    ``min_split_tokens`` tokens per split. ``max_len`` is the block-table capacity (no sync)."""
    programs = max(batch * head_groups, 1)
    slots = max(1, int(cfg["programs_per_sm"]) * V.num_sms(device))
    overhead = float(cfg["split_overhead_tokens"])
    limit = max(1, min(_MAX_SPLITS, math.ceil(max(max_len, 1) / int(cfg["min_split_tokens"]))))
    best, best_cost = 1, float("inf")
    for splits in range(1, limit + 1):
        waves = math.ceil(programs * splits / slots)
        cost = waves * (max_len / splits + overhead)
        if cost < best_cost * 0.999:  # ties go to fewer splits (less merge work)
            best, best_cost = splits, cost
    return best


def gluon_form(q: torch.Tensor, kv: torch.Tensor, L: int, R: int, block_h: int,
               cfg: dict[str, Any]) -> str | None:
    """The Gluon kernel that serves here (``config["gluon"]`` on Hopper): "tokens" at 16 heads
    or fewer, "heads" above 32 in head groups of ``block_h`` = 64; None: the Triton kernels."""
    if tokens_gluon.usable(q, kv, L, R, kv.shape[1], cfg):
        return "tokens"
    if block_h == heads_gluon.BH and heads_gluon.usable(q, kv, L, R, kv.shape[1], cfg) \
            and (not V.is_fp8(kv.dtype) or heads_fp8_ws.serves(kv)):
        return "heads"
    return None


def _fp8_query(kv: torch.Tensor, cfg: dict[str, Any]) -> bool:
    """Whether a Gluon kernel reads q in e4m3 for an fp8 cache's scores (``fp8_query``)."""
    return V.is_fp8(kv.dtype) and bool(cfg.get("fp8_query"))


def _balanced(num_splits: int | None, cfg: dict[str, Any]) -> bool:
    """Whether the launch follows the balanced plan (the only one the Gluon kernels serve)."""
    return num_splits is None and bool(cfg.get("balanced"))


def query_as_read(q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int,
                  num_splits: int | None = None, config: dict | None = None) -> torch.Tensor:
    """q as ``mla_decode`` reads it for this cache, split count and config: where a Hopper
    Gluon kernel serves e4m3 KV with ``config["fp8_query"]`` (the CUDA default), q quantised
    to e4m3 with a scale a head, dequantised (fp32); else q. A reference fed this checks the
    kernels alone."""
    H = q.shape[1]
    cfg = decode_config(H, q.device, config, fp8=V.is_fp8(kv_cache.dtype),
                        fp32_q=q.dtype == torch.float32)
    L, R = kv_lora_rank, q.shape[2] - kv_lora_rank
    if not (_balanced(num_splits, cfg) and _fp8_query(kv_cache, cfg)
            and gluon_form(q, kv_cache, L, R, cfg["BLOCK_H"], cfg)):
        return q
    return e4m3_query(q, kv_cache.dtype)


def e4m3_query(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q`` quantised to ``dtype`` a scale a head (``quantise_rows``), dequantised (fp32)."""
    data, scale = quantise_rows(q.reshape(-1, q.shape[2]), dtype)
    return (data.float() * scale[:, None]).view(q.shape)


def balanced_programs(head_groups: int, device: torch.device, cfg: dict[str, Any]) -> int:
    """Programs one head group may fill when the splits follow the batch's work:
    ``programs_per_sm`` resident programs on every SM, shared by the head groups."""
    return max(1, int(cfg["programs_per_sm"]) * V.num_sms(device) // max(head_groups, 1))


def _check_decode_args(q, kv_cache, block_table, seq_lens, kv_lora_rank, kv_scale):
    V.check_tensor("q", q, 3, V.FLOAT_DTYPES)
    dev = q.device
    kv = V.check_kv_cache(kv_cache, dev)
    V.check_kv_scale(kv, kv_scale)
    if not V.is_fp8(kv.dtype) and kv.dtype != q.dtype:
        raise ValueError(f"q is {q.dtype} but kv_cache is {kv.dtype}; they must match (or fp8 KV)")
    D = kv.shape[2]
    V.check_dim("q", q, 2, D, "the KV row width L + R of kv_cache")
    if not isinstance(kv_lora_rank, int) or not 0 < kv_lora_rank < D:
        raise ValueError(f"kv_lora_rank={kv_lora_rank!r} must be an int in (0, D={D})")
    V.check_tensor("block_table", block_table, 2, V.INDEX_DTYPES, dev)
    V.check_tensor("seq_lens", seq_lens, 1, V.INDEX_DTYPES, dev)
    return kv


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    kv_lora_rank: int,
    kv_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode: ``q`` (N, H, L+R), ``kv_cache`` (P, PS, L+R), ``block_table``
    (N, max_pages), ``seq_lens`` (N,) -> ``(out (N, H, L) in q.dtype, lse (N, H) fp32)``.
    A length of 0 gives out 0 and lse -inf. ``num_splits=None`` picks it from N, the block-table
    capacity and the device's SM count, or with ``config["balanced"]`` per request from the
    batch's lengths (see the module docstring)."""
    kv = _check_decode_args(q, kv_cache, block_table, seq_lens, kv_lora_rank, kv_scale)
    N, H, D = q.shape
    L, R = kv_lora_rank, D - kv_lora_rank
    P, PS = kv.shape[0], kv.shape[1]
    V.check_dim("block_table", block_table, 0, N, "one row per query row of q")
    V.check_dim("seq_lens", seq_lens, 0, N, "one length per query row of q")
    V.check_paged_lengths(block_table, seq_lens, PS, P)
    out = torch.empty((N, H, L), dtype=q.dtype, device=q.device)
    lse = torch.empty((N, H), dtype=torch.float32, device=q.device)
    if N == 0 or H == 0:
        return out, lse

    cfg = decode_config(H, q.device, config, fp8=V.is_fp8(kv.dtype),
                        fp32_q=q.dtype == torch.float32)
    BLOCK_H, BLOCK_N = cfg["BLOCK_H"], cfg["BLOCK_N"]
    head_groups = triton.cdiv(H, BLOCK_H)
    if num_splits is None:
        num_splits = cfg.get("num_splits")
    balanced = _balanced(num_splits, cfg)
    if num_splits is None and not balanced:
        num_splits = choose_num_splits(N, head_groups, block_table.shape[1] * PS, q.device, cfg)
    if not balanced and (not isinstance(num_splits, int) or not 1 <= num_splits <= 65535):
        raise ValueError(f"num_splits={num_splits!r} must be an int in [1, 65535]")
    if N > 65535:
        raise ValueError(f"mla_decode takes at most 65535 rows per launch, got N={N}")
    scale = kv_scale if kv_scale is not None else lse  # never read unless fp8
    is_fp8 = V.is_fp8(kv.dtype)
    fp16_products = is_fp8 and bool(cfg.get("fp8_fp16", False))
    consts = dict(
        L=L, R=R, PAGE_SIZE=PS, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N,
        BLOCK_L=V.next_pow2(L), BLOCK_R=V.next_pow2(R), IS_FP8=is_fp8,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 and not fp16_products else None,
        FP8_FP16=fp16_products, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        FP8_PTX=V.ptx_fp8_widen(cfg, fp16_products, kv.dtype, q.device),
        PDL=(on := pdl(q.device)), launch_pdl=on,
    )
    if cfg.get("maxnreg") and q.is_cuda and torch.version.hip is None:
        consts["maxnreg"] = int(cfg["maxnreg"])  # a register cap for ptxas (occupancy)
    kernel = _mla_decode_kernel
    pages = cfg.get("gather_pages")
    if pages is True:  # blocks of about 4K tokens
        pages = min(256, V.next_pow2(max(4096 // PS, BLOCK_N // PS, 1), 1))
    if pages:
        if not isinstance(pages, int) or pages & (pages - 1) or pages * PS < BLOCK_N:
            raise ValueError(f"config gather_pages={pages!r}: a power of two of pages holding "
                             f"at least a tile ({BLOCK_N} tokens, page {PS})")
        consts["PAGES"] = pages
    gluon = gluon_form(q, kv, L, R, BLOCK_H, cfg) if balanced else None
    # dim_chunks is a form of the heads-on-M kernel for latents of at least 16 columns a chunk
    if cfg.get("dim_chunks") and consts["BLOCK_L"] >= 16 * CHUNKS.value:
        kernel = _mla_decode_chunked_kernel
        # the Triton kernel re-reads q every tile: cast once, as _q_operand would (the Gluon
        # kernels read the 16-bit q themselves: the cast's three launches cost a 16-head fp8
        # layer 6-12 us, decode_fp8_query_cast.json)
        if fp16_products and not gluon:
            q = q.float().clamp_(-65504.0, 65504.0).to(torch.float16)
    inputs = (*q.stride(), *kv.stride(), *(scale.stride() if kv_scale is not None else (0, 0)),
              *block_table.stride(), seq_lens.stride(0))
    if balanced:
        if gluon and "gluon_programs_per_sm" in cfg:  # its own occupancy (shared memory)
            cfg = {**cfg, "programs_per_sm": cfg["gluon_programs_per_sm"]}
        programs = balanced_programs(head_groups, q.device, cfg)
        split = programs > N + 1  # else every request is one program's
        rows = programs if split else 1
        o_part = torch.empty((rows, 1, H, L), dtype=torch.float32, device=q.device)
        # requests of at most `low` splits write 16-bit partial rows (here), the rest fp32
        low = V.low_partial_splits(cfg, out.dtype) if split else 0
        o_low = torch.empty(o_part.shape, dtype=out.dtype, device=q.device) if low else o_part
        lse_part = torch.empty((rows, 1, H), dtype=torch.float32, device=q.device)
        launched = max(programs, N)
        min_tiles = max(1, int(cfg["min_split_tokens"]) // BLOCK_N)

        def plan() -> tuple[torch.Tensor, torch.Tensor]:
            meta = torch.empty((N + 1,), dtype=torch.int32, device=q.device)
            items = torch.empty((launched, 4), dtype=torch.int32, device=q.device)
            _decode_plan_kernel[(launched,)](seq_lens, seq_lens.stride(0), N, programs,
                                             min_tiles, items, meta, BLOCK_N=BLOCK_N,
                                             num_warps=4, PDL=on, launch_pdl=on)
            return items, meta

        items, meta = planned(seq_lens, (N, programs, min_tiles, BLOCK_N, q.device), plan)
        if gluon == "tokens" and _fp8_query(kv, cfg):
            tokens_fp8.launch(q, kv, scale, block_table, o_part, o_low, lse_part, out, lse,
                              items, float(sm_scale) * _LOG2E, low)
        elif gluon == "tokens":
            tokens_gluon.launch(q, kv, scale, block_table, o_part, o_low, lse_part, out, lse,
                                items, float(sm_scale) * _LOG2E, low)
        elif gluon == "heads" and heads_fp8_ws.serves(kv):
            heads_fp8_ws.launch(q, kv, scale, block_table, o_part, o_low, lse_part, out, lse,
                                items, float(sm_scale) * _LOG2E, low)
        elif gluon == "heads":
            heads_gluon.launch(q, kv, block_table, o_part, o_low, lse_part, out, lse,
                               items, float(sm_scale) * _LOG2E, low)
        else:
            kernel[(head_groups, launched)](
                q, kv, scale, block_table, seq_lens, o_part, o_low, lse_part, out, lse, items,
                float(sm_scale) * _LOG2E, H, 1, N, *inputs,
                *o_part.stride(), *lse_part.stride(), *out.stride(), *lse.stride(),
                BALANCED=True, LOW_SPLITS=low, **consts,
            )
        if split:
            _merge_into(o_part, lse_part, out, lse, ranges=meta, low=(o_low, low),
                        max_rows=programs - N + 1)
        return out, lse

    assert isinstance(num_splits, int)  # checked above
    if num_splits == 1:
        o_part, lse_part = out, lse  # the program writes the final output itself
        stride_os, stride_ls = 0, 0
    else:
        o_part = torch.empty((num_splits, N, H, L),
                             dtype=V.partial_dtype(cfg, out.dtype, num_splits), device=q.device)
        lse_part = torch.empty((num_splits, N, H), dtype=torch.float32, device=q.device)
        stride_os, stride_ls = o_part.stride(0), lse_part.stride(0)
    grid = (head_groups, num_splits, N)
    parts = (stride_os, *o_part.stride()[-3:], stride_ls, *lse_part.stride()[-2:])
    kernel[grid](
        q, kv, scale, block_table, seq_lens, o_part, o_part, lse_part, out, lse, seq_lens,
        float(sm_scale) * _LOG2E, H, num_splits, N, *inputs, *parts,
        *out.stride(), *lse.stride(), BALANCED=False, **consts,
    )
    if num_splits > 1:
        _merge_into(o_part, lse_part, out, lse)
    return out, lse
