"""How many KV pages a rank gets: what is left of its memory budget once everything else that
lives on the device is counted (vLLM's profile run, in this engine's terms).

    pages = (budget - weights - activation reserve - graph reserve) // page bytes

- **budget**: ``memory_fraction`` of the device less what other processes hold there, split
  among the ranks sharing it (`setup._budget_bytes`).
- **weights**: what a rank holds outside the pool. Before the workers start this is the memory
  model's count; afterwards the largest rank's measurement. Both add the projection heads a
  rank may come to hold later: at T > 1 a switch to a layout with replicated projections (DP,
  CP) places every head on every rank, and a worker replaying CUDA graphs keeps both
  placements for the engine's life (the graphs read their addresses).
- **activation reserve**: the peak of the largest step the scheduler can build, a prefill chunk
  of ``max_num_batched_tokens`` rows or a decode batch of the largest bucket, at the longest
  context. GPU workers measure it by running those steps before the pool exists (the
  *profiling steps*); the reserve is never below the analytic estimate below, which also
  covers layouts other than the start one (DP runs all heads of a rank's rows) and contexts
  past the profiling steps' (the expanded prefill gathers a chunk's whole history).
- **graph reserve**: the CUDA graphs' memory pool (graphs share one pool and never replay
  together, so it holds about one decode step's activations) plus every graph's static
  buffers; 0 without graphs.

A configuration whose pool comes out empty is refused at start with the knob to change.
"""

from __future__ import annotations

from dataclasses import dataclass

from splash.core.dtypes import dtype_bytes
from splash.core.memory import MemoryModel
from splash.core.ownership import LAYOUTS
from splash.errors import ConfigError
from splash.layouts.expanded import EXPANDED_BUDGET
from splash.layouts.expanded import mode as expanded_mode
from splash.layouts.sparse import SCORE_BUDGET
from splash.model.config import ModelConfig

GIB = 2**30
_LOGIT_COPIES = 4  # fp32 logits, softmax, sorted values and their int64 indices (sampling)
_PROMPT_LOGPROB_ROWS = 256  # rows of prompt logprobs scored at once (splash/engine/sampling.py)


@dataclass(frozen=True)
class StepLimits:
    """The largest step the scheduler may build; the profiling steps run exactly these."""

    prefill_rows: int  # max_num_batched_tokens
    decode_rows: int  # the largest decode batch (per rank under owned-KV layouts when padded)
    sample_rows: int  # rows sampled in one step (at most max_num_seqs)
    context: int  # the longest context (max_model_len)


def activation_estimate(cfg: ModelConfig, world: int, dtype: str, limits: StepLimits) -> int:
    """Peak activation bytes of the largest step on one rank, from model dimensions: the rows
    of the step through a layer (hidden states, queries and latent outputs of every head, the
    MLP's intermediate share), DSA's indexer scores (bounded per call) and picks, and the logits
    sampled (or scored for prompt logprobs) at the end."""
    rows = max(limits.prefill_rows, limits.decode_rows * world)
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    experts = (cfg.num_experts_per_tok or 0) + (cfg.n_shared_experts or 0)
    inter = max(cfg.intermediate_size, experts * (cfg.moe_intermediate_size or 0))
    per_row = dtype_bytes(dtype) * (8 * cfg.hidden_size + 4 * cfg.num_attention_heads * latent
                                    + 3 * inter // world)
    scores = 0
    if cfg.is_dsa:  # fp32 indexer scores, at most SCORE_BUDGET per call, and the picks
        per_row += 8 * int(cfg.index_topk or 0)
        scores = 4 * min(rows * limits.context, SCORE_BUDGET)
    logits = (max(limits.sample_rows, _PROMPT_LOGPROB_ROWS) * cfg.vocab_size * 4
              * _LOGIT_COPIES)
    return rows * per_row + scores + logits + _expanded_bytes(cfg, dtype, limits)


def _expanded_bytes(cfg: ModelConfig, dtype: str, limits: StepLimits) -> int:
    """A prefill chunk run expanded (`splash.layouts.expanded`): its whole history gathered and
    dequantised (two copies of the latent rows, growing with the context past what the profiling
    steps reach) beside the expanded keys and values of at most ``EXPANDED_BUDGET`` bytes."""
    if limits.prefill_rows < 2 or expanded_mode() == "off":
        return 0
    b = dtype_bytes(dtype)
    per_key = (cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
               + cfg.qk_rope_head_dim)
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    return min(EXPANDED_BUDGET, limits.context * per_key * b) + 2 * limits.context * latent * b


GRAPH_MARGIN = 1.25
# what capturing takes however small the model: the warm-up's and the capture's streams each
# get a cuBLAS workspace (32 MiB on Hopper) and their first blocks (the tests' tiny model took
# 70 MiB for 16 graphs and 72 for 76 on an H100)
GRAPH_BASE = 80 * 2**20


def graph_reserve(step_bytes: int, num_layouts: int, buckets: list[int], world: int,
                  hidden: int, dtype: str) -> int:
    """The CUDA graph pool: one decode step's activations (``step_bytes``; graphs share one
    pool and never replay together) plus each start-up graph's static output rows (a bucket's
    rows on every rank, at most), with a margin, plus ``GRAPH_BASE``. Measured at T=1 (H100,
    76 graphs, ``captured ... MiB`` in the log): V3 dimensions with 4 layers 450 MiB against
    1,768 estimated, the tests' tiny V3 in fp32 72 MiB against 85."""
    rows = num_layouts * sum(buckets) * world * hidden * dtype_bytes(dtype)
    return int(GRAPH_MARGIN * (step_bytes + rows)) + GRAPH_BASE


def held_projection_bytes(memory: MemoryModel, fitting: tuple[str, ...], keep_all: bool) -> int:
    """Projection bytes a rank may hold at once over a run visiting the ``fitting`` layouts:
    the largest placement, or with ``keep_all`` (CUDA graphs keep every placement held) the
    sum of the distinct ones (head-sharded and replicated)."""
    sizes = {memory.projection_bytes_per_rank(LAYOUTS[n]) for n in fitting}
    return sum(sizes) if keep_all else max(sizes)


@dataclass(frozen=True)
class MemoryBudget:
    """One rank's memory, item by item (bytes); see the module docstring."""

    budget: int
    weights: int
    activations: int
    graphs: int
    page_bytes: int
    measured: bool = False  # weights and activations measured by the workers

    @property
    def kv_bytes(self) -> int:
        return self.budget - self.weights - self.activations - self.graphs

    def pages(self) -> int:
        return max(self.kv_bytes // self.page_bytes, 0)

    def describe(self) -> str:
        how = "measured" if self.measured else "estimated"
        return (f"budget {_size(self.budget)} = weights {_size(self.weights)} + activations "
                f"{_size(self.activations)} ({how}) + CUDA graphs {_size(self.graphs)} + KV "
                f"{_size(max(self.kv_bytes, 0))}")

    def as_dict(self) -> dict[str, float | bool]:
        return {"budget_gib": self.budget / GIB, "weights_gib": self.weights / GIB,
                "activation_reserve_gib": self.activations / GIB,
                "graph_reserve_gib": self.graphs / GIB,
                "kv_gib": max(self.kv_bytes, 0) / GIB, "measured": self.measured}

    def check(self, pages: int, explicit: bool) -> None:
        """Refuse a pool that does not fit (``explicit``: kv_pages_per_rank asked for it) with
        the one knob that frees the most memory."""
        if pages * self.page_bytes <= self.kv_bytes and pages >= 1:
            return
        if explicit:
            raise ConfigError(
                f"kv_pages_per_rank={pages} needs {_size(pages * self.page_bytes)} per rank but "
                f"only {_size(max(self.kv_bytes, 0))} are left ({self.describe()}): "
                f"lower kv_pages_per_rank to at most {self.pages()} or raise memory_fraction")
        short = self.page_bytes - self.kv_bytes  # what one page still lacks
        if self.activations >= max(short, self.graphs):
            knob = ("lower max_num_batched_tokens (the largest prefill chunk sets the "
                    "activation reserve)")
        elif self.graphs >= short:
            knob = "lower max_num_seqs (the largest CUDA graph batch) or set enforce_eager"
        else:
            knob = "raise memory_fraction or tp_size (the weights leave no room)"
        raise ConfigError(f"no memory left for the KV cache ({self.describe()}): {knob}")


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / 2**20:.1f} MiB"
