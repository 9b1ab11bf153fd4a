"""EngineConfig: every engine knob in one frozen, self-validating dataclass."""

from __future__ import annotations

from dataclasses import dataclass

from splash.core.ownership import LAYOUT_NAMES
from splash.errors import ConfigError

SWITCH_MODES = ("auto", "background", "live", "blocking")


@dataclass(frozen=True)
class EngineConfig:
    model: str  # checkpoint dir (config.json + safetensors)
    tp_size: int = 1  # T ranks
    backend: str = "auto"  # auto | cpu | cuda | rocm
    layout: str = "auto"  # tp | dp | cp | dop | auto
    dtype: str | None = None  # weights/activations (default: fp32 on CPU, bf16 on GPU)
    kv_dtype: str | None = None  # KV cache (default: the activation dtype)
    index_dtype: str | None = None  # DSA indexer keys (default: fp8 on GPUs unless fp32, else
    # the activation dtype)
    page_size: int | None = None  # tokens per KV page (default: 16 on CPU, 64 on GPU)
    max_model_len: int | None = None  # prompt + output limit (default: the model's)
    kv_pages_per_rank: int | None = None  # physical pages per rank (default: from memory)
    memory_fraction: float = 0.85  # of device memory for weights + KV (GPU)
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # prefill chunk budget (default 256 CPU, 2048 GPU)
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True  # reuse the KV pages of cached prefixes (hashed pages)
    # auto | background (pre-copy while serving, then hand off) | live (layer-pipelined within
    # one step) | blocking (move everything, then compute: the baseline)
    switch_mode: str = "auto"
    # every rank holds the projection heads of every layout from the start (head-sharded and
    # replicated), so no switch moves weights; None: when CUDA graphs are on at T > 1 (their
    # captured addresses keep every placement held anyway, so it costs no extra memory)
    resident_projections: bool | None = None
    policy_margin: float = 0.1  # auto: switch when the best layout leads by this fraction
    worker_addr: str | None = None  # bind here and wait for torchrun-started workers
    enforce_eager: bool = False  # no CUDA graphs for decode steps (they are on by default on CUDA)
    # schedule step N + 1 while step N computes (its tokens read on the workers from N's draws)
    async_scheduling: bool = True
    # compile the kernels at start-up (a short request in every layout the engine may use);
    # None: on GPUs (the CPU's Triton interpreter compiles nothing)
    warmup: bool | None = None

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ConfigError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.layout not in (*LAYOUT_NAMES, "auto"):
            raise ConfigError(f"layout must be one of {[*LAYOUT_NAMES, 'auto']}, got {self.layout!r}")
        if self.page_size is not None and self.page_size < 1:
            raise ConfigError(f"page_size must be >= 1, got {self.page_size}")
        if self.kv_pages_per_rank is not None and self.kv_pages_per_rank < 1:
            raise ConfigError("kv_pages_per_rank must be >= 1")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ConfigError("memory_fraction must lie in (0, 1]")
        if self.index_dtype not in (None, "fp32", "fp16", "bf16", "fp8"):
            raise ConfigError(f"index_dtype must be fp32, fp16, bf16 or fp8, got {self.index_dtype!r}")
        if self.switch_mode not in SWITCH_MODES:
            raise ConfigError(f"switch_mode must be one of {SWITCH_MODES}, got "
                              f"{self.switch_mode!r}")
