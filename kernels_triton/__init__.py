"""Triton kernels (installed as ``splash.kernels_triton``).

Every launcher validates its arguments (``ValueError`` with a clear message), allocates outputs and
computes its grid; every kernel has a torch reference ``*_ref`` beside it. Launch parameters come
from the backend's tuning table (``config``) or fall back to per-device defaults.

Triton compiles one binary per class of each integer argument (equal to 1, a multiple of 16,
other). Integers that change from step to step without steering vectorisation (a block table's
row stride, row and split counts) are marked ``do_not_specialize``, so a kernel compiled by the
engine's start-up warm-up serves every later step: a new prompt length or table width never
compiles mid-serving. Bounds that are always multiples of 16 (history lengths in whole pages)
keep their specialisation. What a step's shape still selects, a constexpr, is compiled ahead by
``warm_selection`` (DSA's tiles per program and top-k passes).
"""

from splash.kernels_triton._validate import set_value_checks, value_checks_enabled
from splash.kernels_triton.dsa_index import index_scores, index_scores_ref
from splash.kernels_triton.exchange import (
    expand_runs,
    expand_runs_ref,
    gather_layer_rows,
    gather_layer_rows_ref,
    gather_rows,
    gather_rows_ref,
    merge_heads_from_ranks,
    merge_heads_from_ranks_ref,
    scatter_layer_rows,
    scatter_rows,
    scatter_rows_ref,
    split_heads_to_ranks,
    split_heads_to_ranks_ref,
)
from splash.kernels_triton.fused_moe import fused_moe, fused_moe_ref
from splash.kernels_triton.kv_cache_ops import (
    kv_gather,
    kv_gather_ref,
    kv_write,
    kv_write_ref,
    quantise_rows,
    quantise_rows_ref,
)
from splash.kernels_triton.lse_merge import lse_merge, lse_merge_ref
from splash.kernels_triton.mla_decode import choose_num_splits, mla_decode
from splash.kernels_triton.mla_decode_plan import plan_scope
from splash.kernels_triton.mla_decode_ref import mla_decode_ref
from splash.kernels_triton.mla_extend import mla_extend, mla_extend_ref
from splash.kernels_triton.mla_sparse import mla_sparse, mla_sparse_ref
from splash.kernels_triton.moe_align import moe_align
from splash.kernels_triton.moe_route import moe_route, moe_route_ref
from splash.kernels_triton.rms_norm import (
    add_rms_norm,
    add_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)
from splash.kernels_triton.rope import rope, rope_ref
from splash.kernels_triton.topk import topk_rows, topk_rows_ref

__all__ = [
    "add_rms_norm",
    "add_rms_norm_ref",
    "choose_num_splits",
    "fused_moe",
    "fused_moe_ref",
    "expand_runs",
    "expand_runs_ref",
    "gather_layer_rows",
    "gather_layer_rows_ref",
    "gather_rows",
    "gather_rows_ref",
    "index_scores",
    "index_scores_ref",
    "kv_gather",
    "kv_gather_ref",
    "kv_write",
    "kv_write_ref",
    "lse_merge",
    "lse_merge_ref",
    "merge_heads_from_ranks",
    "merge_heads_from_ranks_ref",
    "mla_decode",
    "mla_decode_ref",
    "mla_extend",
    "mla_extend_ref",
    "mla_sparse",
    "mla_sparse_ref",
    "moe_align",
    "plan_scope",
    "quantise_rows",
    "quantise_rows_ref",
    "scatter_layer_rows",
    "scatter_rows",
    "scatter_rows_ref",
    "set_value_checks",
    "split_heads_to_ranks",
    "split_heads_to_ranks_ref",
    "moe_route",
    "moe_route_ref",
    "rms_norm",
    "rms_norm_ref",
    "rope",
    "rope_ref",
    "topk_rows",
    "topk_rows_ref",
    "value_checks_enabled",
]
