"""NVIDIA CUDA backend (profiles h200, b200): NCCL collectives, fp8 e4m3fn KV."""

from __future__ import annotations

import torch

from splash.backends.base import BaseBackend, register_backend


@register_backend
class CUDABackend(BaseBackend):
    name = "cuda"
    dist_backend = "nccl"
    wave_size = 32
    TUNING = {
        # mla_decode (measured on H200, benchmarks/results/h200/kernels.json): bf16 with H <= 32
        # uses the heads-on-M kernel with 64-token tiles (one page), 4 warps, 3 stages, 2
        # programs per SM in the launcher's wave model (16 heads, graph-timed: 64 x 32K 0.602 vs
        # 0.743 ms for the tokens-on-M kernel with 32-token tiles, 16 x 128K 0.602 vs 0.744,
        # 64 x 4K 0.094 vs 0.102; benchmarks/results/h200/decode_configs.json); H > 32
        # ("many_heads") uses 64-head groups on M: 64 heads x 512 fp32 accumulators need 8
        # warps, and 64-token tiles (2 stages fit shared memory) lifted 128 heads from 177 to
        # 276-281 TFLOP/s. fp8 KV with H <= 32 keeps the heads-on-M kernel (tokens-on-M: 0.347
        # vs 0.124 ms at 64 x 4K, 2.65 vs 0.815 at 64 x 32K, fp8_decode.json), 2 programs per
        # SM in the wave model (one an SM, as its shared memory allows: 64 x 4K 0.123 -> 0.117
        # but 8 x 4K 0.029 -> 0.032; not taken).
        # Many heads at short contexts: 64-token splits (benchmarks/results/h200/
        # decode_splits.json, 64 heads, 1 x 1K: 16 splits 13.8 us vs 4 splits 21.8 us; the
        # wave model then picks the measured-best split at 1-16 x 1K and keeps it elsewhere).
        # fp8 KV: "fp8_fp16" runs the products on fp16 operands (native fp8 -> fp16
        # conversion; q clamped to fp16's range), the tile widened once in PTX for both
        # products (benchmarks/results/h200/fp8_decode.json, 16 heads, 3 stages: 64 x 32K
        # 1.046 ms with a plain cast -> 0.860; 128 heads 8 x 32K: fp16 products with 64-token
        # tiles 0.551 ms, against 0.645 for bf16 products and 0.770 for fp16 products with
        # 32-token tiles, fp8_decode_round1.json).
        # "balanced": split counts from the batch's total work, planned on the device
        # (benchmarks/results/h200/decode_balance.json, 16 heads: one 128K request among 63 of
        # 1K 1.72 -> 0.104 ms, 64 over 1K-32K 0.532 -> 0.447; uniform batches 2-5% slower than
        # the wave model's splits).
        # "dim_chunks" (few heads): the latent dims in four column chunks, no register spills
        # (benchmarks/results/h200/fp8_decode.json, 16 heads, bf16: 64 x 4K 0.098 -> 0.087 ms,
        # 64 x 32K 0.601 -> 0.556, 16 x 128K 0.602 -> 0.559; fp8 0.900 -> 0.838 at 64 x 32K;
        # a ptxas cap of 168 registers lost 8-13%).
        # "gather_pages" with fp8 KV at few heads: page ids loaded in blocks and gathered, so
        # Triton pipelines the tile copies, on 64-token tiles (decode_chunks.json, 16 heads:
        # 64 x 32K 0.839 -> 0.802 ms, 16 x 128K 0.840 -> 0.804, 128 x 1K 0.080 -> 0.072,
        # 64 x 4K 0.127 -> 0.124). It loses with bf16 at long contexts (64 x 32K 0.557 ->
        # 0.603) and at 128 heads (bf16 0.269 -> 0.355 on the 32-token tiles that fit).
        # "gluon" (sm_90, balanced plan): the Gluon kernels, a layer's ms against the Triton
        # kernels in the same run. Few heads, tokens on M: bf16 with TMA tiles, one program an
        # SM ("gluon_programs_per_sm": 1; decode_tokens_gluon.json): 64 x 4K 0.0815 -> 0.0792,
        # 64 x 32K 0.552 -> 0.546, 8 x 4K 0.0217 -> 0.0159, one 128K among 63 of 1K 0.089 ->
        # 0.076, but 64 over 1K-32K 0.352 -> 0.370 and 128 over 256-2K 0.059 -> 0.064 (two
        # programs an SM lose the uniform shapes instead); fp8 widened in shared memory, two
        # programs an SM (fp8_decode_gluon.json): 64 x 32K 0.798 -> 0.746, 64 x 1K 0.047 ->
        # 0.041, 8 x 4K 0.027 -> 0.030. Many heads, two warpgroups on 64 heads
        # (decode_heads_gluon.json): bf16 64 x 4K 0.264 -> 0.188, 64 x 32K 2.003 -> 1.406
        # (0.179 / 1.329 with p's sums deferred, decode_heads_defer_sum.json);
        # fp8 (decode_heads_gluon_fp8.json) 64 x 4K 0.535 -> 0.454, 64 x 32K 4.08 -> 3.24;
        # then with q read in e4m3 for the scores ("fp8_query", decode_heads_fp8_scores.json)
        # 64 x 4K 0.458 -> 0.270, 64 x 32K 3.29 -> 1.95 (bf16 in the same run 0.181 / 1.344);
        # then the value product turned around with its e4m3 operand widened in registers
        # (a kernel since removed, decode_heads_fp8_registers.json):
        # 64 x 4K 0.269 -> 0.225, 64 x 32K 1.93 -> 1.52, 128 x 1K 0.158 -> 0.147 (bf16 0.181 /
        # 1.352 / 0.106); then as one-warpgroup programs of 32 heads, two an SM
        # (decode_heads_fp8_tried_s29.json): 8 x 32K 0.232 -> 0.214, 128 x 1K 0.147 -> 0.131,
        # 64 x 32K 1.526 either way. Then two warpgroups on 64 heads again, with the widening
        # and the tile copies in a warpgroup of their own and the rows' scales by TMA
        # (mla_decode_heads_fp8_ws, since the only e4m3 form at many heads; H100, same run,
        # results/h100/decode_heads_fp8_ws.json): 64 x 4K 0.2066 -> 0.1760 (bf16 0.1752),
        # 64 x 32K 1.519 -> 1.176 (1.301), 8 x 32K 0.2049 -> 0.1770 (0.1784), 2 x 128K
        # 0.2071 -> 0.1682 (0.1791), 128 x 1K 0.1118 -> 0.1077 (0.0985); with q quantised in
        # the kernel and two stages (decode_heads_fp8_ws_query.json): 64 x 4K 0.1579 (bf16
        # 0.1774), 64 x 32K 1.098 (1.311), 8 x 32K 0.1638 (0.1815), 2 x 128K 0.1606 (0.1805),
        # 128 x 1K 0.0898 (0.0993).
        # Few heads with "fp8_query" (mla_decode_tokens_fp8: e4m3 stages by TMA, fp8 scores,
        # the value operand widened in registers; decode_tokens_fp8_regs.json, against the
        # tile widened in shared memory, bf16 in the same run): 64 x 4K 0.1184 -> 0.0659
        # (bf16 0.0784), 64 x 32K 0.759 -> 0.328 (0.546), 16 x 128K 0.759 -> 0.332 (0.548),
        # 128 x 1K 0.0755 -> 0.0515 (0.0448), 8 x 4K 0.0297 -> 0.0270 (0.0159); then without
        # the fp16 cast of q the Triton kernels need (decode_fp8_query_cast.json): 64 x 4K
        # 0.0619 -> 0.0545, 128 x 1K 0.0483 -> 0.0363, 8 x 4K 0.0261 -> 0.0204.
        # "low_partials": 8: requests of at most 8 splits write 16-bit partials, longer ones
        # fp32 (benchmarks/results/h200/decode_low_partials.json, a layer's ms against fp32
        # partials: 16 heads bf16 64 x 4K -1.1%, 128 x 1K -2.8%, 64 x 1K -4.2%; 128 heads
        # 8 x 4K -10%; fp8 64 x 1K -2.7%; others within +-1%. Every request in 16-bit: one 128K
        # request among 63 of 1K +12%, 16 heads 8 x 4K (16 splits each) +5%).
        "mla_decode": {
            "default": {
                "balanced": True, "dim_chunks": True, "BLOCK_N": 64,
                "BLOCK_H": 16, "low_partials": 8, "gluon": True, "gluon_programs_per_sm": 1,
                "num_warps": 4, "num_stages": 3, "max_block_h": 64, "programs_per_sm": 2,
                "split_overhead_tokens": 512, "min_split_tokens": 256,
                "many_heads": {"dim_chunks": False, "BLOCK_H": 64,
                               "BLOCK_N": 64,
                               "num_warps": 8, "num_stages": 2, "programs_per_sm": 1,
                               "split_overhead_tokens": 64, "min_split_tokens": 64},
                "fp8": {"BLOCK_N": 64, "gather_pages": True,
                        "gluon_programs_per_sm": 2, "fp8_query": True,
                        "num_warps": 4, "num_stages": 3,
                        "programs_per_sm": 2, "split_overhead_tokens": 64, "fp8_fp16": True,
                        "many_heads": {"BLOCK_N": 64, "gather_pages": False, "num_warps": 8,
                                       "num_stages": 2, "programs_per_sm": 1,
                                       "fp8_fp16": True, "gluon_programs_per_sm": 1,
                                       "fp8_query": True}},
            },
        },
        # mla_sparse (benchmarks/results/h200/dsa_sweep.json, batch 16 x 2,048 selected rows):
        # over mla_decode's entry, 64-token tiles on 8 warps, 2 stages at every head count and
        # KV dtype swept (16 heads bf16 0.022 ms vs 0.029 with decode's 32-token tiles; 128
        # heads bf16 0.057 ms); at 128 heads the launcher's 4 splits beat 2 / 8 / 16 and 3
        # stages lose with bf16 (0.066 ms) and gain 7% with fp8 (0.085 -> 0.079 ms,
        # dsa_sparse_splits.json)
        # fp8 KV at many heads keeps bf16 products here (128 heads: 0.084 vs 0.094 ms with
        # decode's fp16 products)
        # "gather_slots" (slot ids loaded once per split and gathered, so the copies pipeline;
        # dsa_gather.json): 16 heads with 3 stages bf16 0.0221 -> 0.0205 ms, fp8 0.0224 ->
        # 0.0217; 128 heads fp8 with 2 stages 0.0841 -> 0.0763; 128 heads bf16 loses (0.0569
        # -> 0.0585) and 3 stages overflow shared memory there
        # "dim_chunks" at every head count (dsa_sparse_chunks.json): 16 heads bf16 0.0204 ->
        # 0.0186 ms, fp8 0.0239 -> 0.0207; 128 heads bf16 0.0568 -> 0.0515, fp8 0.0766 -> 0.0666
        # 4 warps at few heads with bf16 KV (dsa_sparse_chunks.json: 16 heads 0.0176 ->
        # 0.0168 ms; fp8 0.0197 -> 0.0202 and 128 heads 0.052 -> 0.078 keep 8)
        # fp32 partials (16-bit ones, decode_partials.json: 16 heads bf16 0.0163 -> 0.0172 ms)
        # "gluon" (the Gluon decode kernels gathering the selected rows by cp.async,
        # dsa_sparse_gluon*.json, against the Triton kernel in the same run): 128 heads bf16
        # 0.0519 -> 0.0418 ms (8 tiles a split; a DSA layer at 32K 0.1006 -> 0.0906); at 4
        # tiles a split slower (64 heads 0.0292 -> 0.0300, 16 heads 0.0163 -> 0.0171: the
        # copies have no time to overlap), hence "gluon_min_split_tiles"; nor with fp8 KV (16
        # heads 0.0194 -> 0.0272, 128 heads 0.0658 -> 0.0948: the widening loop is serial).
        # e4m3 KV at many heads: the warp-specialised kernel's gathered form (the tiles'
        # rows and scales by cp.async in the widening warpgroup, 16 bytes a copy;
        # results/h100/dsa_sparse_fp8_ws.json, H100, batch 16 x 2,048 selected rows, 128
        # heads, against the Triton kernel in the same run): 0.0680 -> 0.0441 ms at 32K
        # (bf16's Gluon form 0.0441 at 128K), the DSA layer 0.1203 -> 0.1014 at 32K, 0.2109
        # -> 0.1925 at 128K; at 64 heads (a split of 4 tiles: no "gluon_min_split_tiles")
        # 0.0430 -> 0.0351 ms, the layer 0.0974 -> 0.0917 (results/h100/dsa_sparse_fp8_16_64.json;
        # at 16 heads the few-head Gluon kernel's e4m3 gathered form still loses there with
        # 16-byte copies, 0.0196 -> 0.0288)
        "mla_sparse": {"default": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3,
                                   "gather_slots": True, "dim_chunks": True,
                                   "low_partials": False, "gluon": False,
                                   "many_heads": {"num_stages": 2, "gather_slots": False,
                                                  "num_warps": 8, "gluon": True,
                                                  "gluon_min_split_tiles": 8},
                                   "fp8": {"num_warps": 8, "gluon": False,
                                           "many_heads": {"fp8_fp16": False,
                                                          "gather_slots": True,
                                                          "gluon": True,
                                                          "gluon_min_split_tiles": 0}}}},
        # mla_extend: 64-token KV tiles (298 vs 199 TFLOP/s); compute-bound, so fp8 KV keeps
        # bf16 products (185 vs 145 TFLOP/s with fp16 products)
        "mla_extend": {"default": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2,
                                   "fp8_fp16": False}},
        # mha_extend, the expanded prefill (benchmarks/results/h200/expanded_prefill.json, 128
        # heads, 8K chunk): 128-row query blocks, 64-key tiles, 8 warps, 3 stages, best at every
        # chunk and head count swept (7.9 vs 9.0 ms at prefix 0 with 64 x 64 on 4 warps;
        # 53.6 vs 74.2 ms at prefix 24K)
        "mha_extend": {"default": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8,
                                   "num_stages": 3}},
        # fused_moe (benchmarks/results/h200/moe_kernel.json, DeepSeek-V2-Lite experts, 4K
        # tokens, bf16): BLOCK_M is the expert alignment shared by both grouped GEMMs; "gate_up"
        # / "down" override per GEMM (gate_up's BLOCK_N counts gate and up columns each). The
        # best gate_up (128x128 x2 accumulators, 8 warps, 4 stages) and down (128x256, 3 stages)
        # of the sweep: 1.10 ms, 52% of the matmul peak (BLOCK_M 64 / 4 warps: 1.31 ms).
        # "tma": weight tiles and down's rows through tensor descriptors, down with 4 stages
        # (benchmarks/results/h200/moe_tma_ab.json, interleaved with the pointer loads: graph
        # 0.944 vs 1.009 ms at 4K tokens, 3.38 vs 3.63 at 16K). moe_kernel.json: graph 0.967 ms,
        # 65% of the same matmul replayed in a graph (678 TFLOP/s sustained; 56% of its eager,
        # L2-flushed 783); eager runs measured 0.865-0.959 ms. Off in the decode entries.
        # Decode batches (benchmarks/results/h200/moe_decode.json, V3 experts, graph-timed,
        # % of the bytes roofline vs the prefill tiles): up to 16 tokens, 16-row blocks and
        # narrow gate_up tiles (enough programs when each rank holds half of every expert:
        # 1 token, I 1,024: 82% vs 59%); up to 64 tokens, 64-row blocks (96% vs 86%). This
        # table re-measured (moe_decode_table.json): 86-102% at every point (1-64 tokens).
        "fused_moe": {
            "default": {"BLOCK_M": 128, "BLOCK_K": 64, "num_warps": 8, "tma": True,
                        "gate_up": {"BLOCK_N": 128, "GROUP_M": 16, "num_stages": 4},
                        "down": {"BLOCK_N": 256, "GROUP_M": 8, "num_stages": 4},
                        "by_tokens": [
                            [16, {"BLOCK_M": 16, "GROUP_M": 1, "num_warps": 4, "tma": False,
                                  "gate_up": {"BLOCK_N": 32, "BLOCK_K": 128, "num_stages": 3},
                                  "down": {"BLOCK_N": 64, "BLOCK_K": 256, "num_stages": 3}}],
                            [64, {"BLOCK_M": 64, "GROUP_M": 1, "BLOCK_K": 128, "tma": False,
                                  "gate_up": {"BLOCK_N": 64, "num_warps": 8, "num_stages": 4},
                                  "down": {"BLOCK_N": 128, "num_warps": 4, "num_stages": 4}}]]},
        },
    }

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available() and torch.version.hip is None

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))

    def detect_profile(self) -> str:
        if not torch.cuda.is_available():
            return "h200"
        name = torch.cuda.get_device_name(0).upper()
        return "b200" if "B200" in name else "h200"

    @property
    def fp8_dtype(self) -> torch.dtype | None:
        return torch.float8_e4m3fn

    def synchronize(self) -> None:
        torch.cuda.synchronize()
