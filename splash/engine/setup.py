"""Engine start-up, resolved once: backend, model, dtypes, the KV pool per layout, limits.

`resolve_setup(cfg)` reads the checkpoint's config and the device's memory and returns a frozen
`EngineSetup` with the KV pool sized from the memory model's estimates (and refuses a
configuration that cannot fit before any worker starts); it changes nothing (CPU workers get
the Triton interpreter in their own processes: `splash.engine.executor`). Once the workers have
loaded their weights and run their profiling steps, `size_from_profiles` sizes the pool again
from what they measured (`splash.engine.memory_plan`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from splash import envs
from splash.backends import BaseBackend, HardwareProfile, get_backend
from splash.core.allocator import RankAllocators
from splash.core.memory import MemoryModel
from splash.core.ownership import LAYOUTS, fitting_layouts, get_layout, kv_capacity_tokens
from splash.core.protocol import WorkerProfile
from splash.engine.config import EngineConfig
from splash.engine.graphs import batch_buckets
from splash.engine.memory_plan import (
    MemoryBudget,
    StepLimits,
    activation_estimate,
    graph_reserve,
    held_projection_bytes,
)
from splash.engine.scheduler import Scheduler, SchedulerConfig
from splash.engine.worker_config import WorkerConfig
from splash.errors import ConfigError, LayoutInfeasibleError, WorkerDiedError
from splash.layouts.expanded import crossover_rows
from splash.layouts.expanded import mode as expanded_mode
from splash.logging_utils import get_logger
from splash.model.config import ModelConfig

logger = get_logger("splash.engine")

_CPU_MAX_PAGES = 4096  # the CPU pool serves tests and demos; keep it small
_GRAPH_MAX_BATCH = 512  # the largest decode batch (per rank under owned-KV layouts) graphed
_GRAPH_CONTEXT = 1024  # start-up graphs cover decode steps whose contexts reach this far


@dataclass(frozen=True)
class EngineSetup:
    """Everything the engine resolved at start-up (see `resolve_setup`)."""

    cfg: EngineConfig
    model_cfg: ModelConfig
    backend_name: str
    profile: HardwareProfile  # feeds the layout policy's cost model
    dtype: str  # weights / activations (fp32, fp16, bf16)
    kv_dtype: str  # the activation dtype or fp8
    index_dtype: str  # DSA indexer keys: the activation dtype or fp8 (unused by other models)
    page_size: int
    memory: MemoryModel
    fitting: tuple[str, ...]  # layouts this model and group can run
    initial_layout: str
    num_pages: int  # physical KV pages per rank
    max_model_len: int
    max_request_tokens: int  # an owned history must fit one rank
    limits: StepLimits  # the largest steps, as profiled
    budget: MemoryBudget  # how the pool was sized
    cuda_graphs: bool
    resident_heads: bool  # every layout's projection heads held from the start: no weight moves
    graph_max_batch: int  # the largest graphed decode batch (per rank under owned KV)

    @property
    def world(self) -> int:
        return self.cfg.tp_size

    @property
    def max_num_batched_tokens(self) -> int:
        """Rows of the largest step (the profiled prefill chunk)."""
        return self.limits.prefill_rows

    def kv_capacity_tokens(self) -> dict[str, int]:
        return {name: kv_capacity_tokens(layout, self.num_pages, self.page_size, self.world)
                if name in self.fitting else 0 for name, layout in LAYOUTS.items()}

    def worker_config(self) -> WorkerConfig:
        lim = self.limits
        return WorkerConfig(model=self.cfg.model, rank=0, world=self.world,
                            backend=self.backend_name, dtype=self.dtype, kv_dtype=self.kv_dtype,
                            index_dtype=self.index_dtype, page_size=self.page_size,
                            layout=self.initial_layout, cuda_graphs=self.cuda_graphs,
                            resident_heads=self.resident_heads,
                            graph_max_batch=self.graph_max_batch,
                            graph_layouts=self.fitting,
                            graph_context=min(self.max_model_len, _GRAPH_CONTEXT),
                            max_model_len=self.max_model_len,
                            profile_prefill_rows=lim.prefill_rows,
                            profile_decode_rows=lim.decode_rows, profile_context=lim.context)


def resolve_setup(cfg: EngineConfig) -> EngineSetup:
    """Backend, model config, dtypes, layouts that fit, KV pages per rank and request limits."""
    if not os.path.isfile(os.path.join(cfg.model, "config.json")):
        raise ConfigError(f"{cfg.model!r} is not a checkpoint dir (no config.json)")
    model_cfg = ModelConfig.from_hf(cfg.model)
    backend = get_backend(cfg.backend)
    on_cpu = backend.name == "cpu"
    how = expanded_mode()  # a bad value is refused here, not by every prefill step
    if how == "auto":
        logger.info("prefill chunks of >= %d rows (over an 8K history) run MLA non-absorbed, "
                    "request by request (SPLASH_MHA_PREFILL=auto; off to disable)",
                    crossover_rows(model_cfg))
    else:
        logger.info("SPLASH_MHA_PREFILL=%s: %s", how, "every prefill step absorbed" if how == "off"
                    else f"prefill steps of >= {how} rows on a rank run MLA non-absorbed")
    # refused here, before any worker starts: a dtype the backend computes wrongly, a KV dtype
    # the kernels cannot read beside the activations
    dtype, kv_dtype = backend.check_dtypes(cfg.dtype or ("fp32" if on_cpu else "bf16"),
                                           cfg.kv_dtype)
    index_dtype = _index_dtype(cfg, backend, dtype)
    page_size = cfg.page_size or (16 if on_cpu else 64)
    world = cfg.tp_size
    fitting = fitting_layouts(model_cfg.num_attention_heads, world)
    initial = _initial_layout(cfg, model_cfg, fitting)
    memory = MemoryModel(model_cfg, world, dtype, kv_dtype, page_size, index_dtype)
    if model_cfg.is_dsa:
        logger.info("DSA: index_topk %d; indexer keys in %d of %d layers stored as %s (%d B per "
                    "token per layer, beside the latent row)", model_cfg.index_topk,
                    model_cfg.num_indexer_layers, model_cfg.num_hidden_layers, index_dtype,
                    memory.index_bytes_per_token_per_layer)
    max_model_len = cfg.max_model_len or model_cfg.max_position_embeddings
    batched = cfg.max_num_batched_tokens or (256 if on_cpu else 2048)
    limits = StepLimits(prefill_rows=batched, decode_rows=min(cfg.max_num_seqs, batched),
                        sample_rows=min(cfg.max_num_seqs, batched), context=max_model_len)
    cuda_graphs = _cuda_graphs(cfg, backend.name)
    graph_max_batch = min(cfg.max_num_seqs, _GRAPH_MAX_BATCH)
    resident = world > 1 and (cuda_graphs if cfg.resident_projections is None
                              else cfg.resident_projections)
    budget = MemoryBudget(
        budget=_budget_bytes(cfg, backend),
        weights=memory.common_bytes_per_rank + held_projection_bytes(
            memory, tuple(fitting), keep_all=cuda_graphs or resident),
        activations=activation_estimate(model_cfg, world, dtype, limits),
        graphs=_graph_reserve(model_cfg, world, dtype, limits, fitting, graph_max_batch, 0)
        if cuda_graphs else 0,
        page_bytes=memory.page_bytes)
    num_pages = _num_pages(cfg, budget, page_size, max_model_len, on_cpu)
    logger.info("engine: %s on %s x%d, layout %s, %d KV pages/rank of %d tokens (%s)",
                model_cfg.model_type, backend.name, world, initial, num_pages, page_size,
                budget.describe())
    return EngineSetup(
        cfg=cfg, model_cfg=model_cfg, backend_name=backend.name, profile=backend.profile,
        dtype=dtype, kv_dtype=kv_dtype, index_dtype=index_dtype, page_size=page_size,
        memory=memory, fitting=tuple(fitting), initial_layout=initial, num_pages=num_pages,
        max_model_len=max_model_len, max_request_tokens=num_pages * page_size,
        limits=limits, budget=budget,
        cuda_graphs=cuda_graphs, resident_heads=resident, graph_max_batch=graph_max_batch)


def size_from_profiles(setup: EngineSetup, profiles: list[WorkerProfile]) -> EngineSetup:
    """The setup with the pool sized from the workers' start-up reports: the largest rank's
    measured weights (plus the projection heads it may hold later), activation peak (never
    below the estimate) and graph reserve. Refuses a configuration that does not fit."""
    failed = [p for p in profiles if p.error]
    if failed:
        p, lim = failed[0], setup.limits
        if p.oom:
            raise ConfigError(
                f"rank {p.rank} ran out of memory in its profiling steps (a prefill of "
                f"{lim.prefill_rows} tokens at context {lim.context}, a decode of "
                f"{lim.decode_rows} rows): lower max_num_batched_tokens (or max_model_len, "
                f"max_num_seqs), or raise tp_size ({p.error})")
        raise WorkerDiedError(f"worker {p.rank} failed to start: {p.error}")
    cfg, memory, old = setup.cfg, setup.memory, setup.budget
    held = held_projection_bytes(memory, setup.fitting,
                                 keep_all=setup.cuda_graphs or setup.resident_heads)
    # what the workers measured holds the start layout's heads, or every layout's if resident
    now = held if setup.resident_heads else \
        memory.projection_bytes_per_rank(get_layout(setup.initial_layout))
    measured = max(p.weight_bytes for p in profiles)
    peak = max(p.activation_bytes for p in profiles)
    decode = max(p.decode_bytes for p in profiles)
    graphs = _graph_reserve(setup.model_cfg, setup.world, setup.dtype, setup.limits,
                            list(setup.fitting), setup.graph_max_batch, decode) \
        if setup.cuda_graphs else 0
    budget = dataclasses.replace(
        old, weights=measured + held - now if measured else old.weights,
        activations=max(peak, old.activations), graphs=graphs, measured=peak > 0)
    num_pages = _num_pages(cfg, budget, setup.page_size, setup.max_model_len,
                           setup.backend_name == "cpu")
    if num_pages != setup.num_pages or peak:
        logger.info("KV pool from the workers' profiles: %d pages/rank (%s)", num_pages,
                    budget.describe())
    return dataclasses.replace(setup, budget=budget, num_pages=num_pages,
                               max_request_tokens=num_pages * setup.page_size)


def _graph_reserve(cfg: ModelConfig, world: int, dtype: str, limits: StepLimits,
                   fitting: list[str], max_batch: int, decode_bytes: int) -> int:
    """The CUDA graph reserve: one decode step of the largest bucket (``decode_bytes``
    measured, else estimated) plus the static buffers of every start-up graph."""
    step = decode_bytes or activation_estimate(
        cfg, world, dtype, dataclasses.replace(limits, prefill_rows=0, decode_rows=max_batch))
    return graph_reserve(step, len(fitting), batch_buckets(max_batch), world, cfg.hidden_size,
                         dtype)


def build_scheduler(setup: EngineSetup) -> Scheduler:
    """The page allocators and the scheduler."""
    cfg, world = setup.cfg, setup.world
    allocators = RankAllocators(world, setup.num_pages)
    layout = get_layout(setup.initial_layout)
    sched_cfg = SchedulerConfig(
        world=world, page_size=setup.page_size, max_model_len=setup.max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=setup.max_num_batched_tokens,
        enable_chunked_prefill=cfg.enable_chunked_prefill,
        enable_prefix_caching=cfg.enable_prefix_caching,
        eos_token_ids=tuple(setup.model_cfg.eos_token_ids))
    return Scheduler(sched_cfg, allocators, layout)


def _index_dtype(cfg: EngineConfig, backend: BaseBackend, dtype: str) -> str:
    """DSA indexer keys: fp8 with a per-key scale (as DeepSeek stores them) where the hardware
    has fp8 and the model does not run in fp32, else the activation dtype; like the KV cache,
    the scoring kernel reads the activation dtype or fp8."""
    fp8 = backend.fp8_dtype is not None
    want = cfg.index_dtype or ("fp8" if fp8 and dtype != "fp32" else dtype)
    if want not in (dtype, "fp8") or (want == "fp8" and not fp8):
        raise ConfigError(f"index_dtype {want} is not supported with dtype {dtype} on the "
                          f"{backend.name} backend; use {dtype}{' or fp8' if fp8 else ''}")
    return want


def _initial_layout(cfg: EngineConfig, model_cfg: ModelConfig, fits: list[str]) -> str:
    if cfg.layout == "auto":
        if len(fits) < len(LAYOUTS):
            logger.info("layouts %s shard %d heads over %d ranks unevenly: auto chooses among %s",
                        [name for name in LAYOUTS if name not in fits],
                        model_cfg.num_attention_heads, cfg.tp_size, fits)
        return "tp" if "tp" in fits else "dp"
    if cfg.layout not in fits:
        raise LayoutInfeasibleError(
            f"layout {cfg.layout!r} shards {model_cfg.num_attention_heads} heads over "
            f"{cfg.tp_size} ranks, which does not divide; layouts that fit: {fits}")
    return cfg.layout


def _num_pages(cfg: EngineConfig, budget: MemoryBudget, page_size: int, max_model_len: int,
               on_cpu: bool) -> int:
    """kv_pages_per_rank if given (refused if it does not fit), else what the budget leaves,
    never more than the scheduler could fill (every sequence at max_model_len)."""
    if cfg.kv_pages_per_rank:
        if not on_cpu:  # the CPU "device" is the host: its budget is nominal
            budget.check(cfg.kv_pages_per_rank, explicit=True)
        return cfg.kv_pages_per_rank
    pages = budget.pages()
    budget.check(pages, explicit=False)
    pages = min(pages, -(-max_model_len // page_size) * cfg.max_num_seqs)
    return min(pages, _CPU_MAX_PAGES) if on_cpu else pages


def _budget_bytes(cfg: EngineConfig, backend: BaseBackend) -> int:
    """memory_fraction of the device, minus what others already use there (like vLLM's
    gpu_memory_utilization), split among the ranks that share one device."""
    if backend.name == "cpu":
        return int(backend.profile.memory_gib * 2**30 * cfg.memory_fraction)
    free, total = torch.cuda.mem_get_info(0)
    sharing = max(1, -(-cfg.tp_size // max(torch.cuda.device_count(), 1)))
    used_by_others = total - free
    return int((total * cfg.memory_fraction - used_by_others) / sharing)


def _cuda_graphs(cfg: EngineConfig, backend_name: str) -> bool:
    """Decode steps from CUDA graphs: on CUDA unless enforce_eager; at T>1 only over NCCL
    (gloo collectives, used to run several ranks on one GPU, cannot be captured)."""
    if backend_name != "cuda" or cfg.enforce_eager:
        return False
    return cfg.tp_size == 1 or (envs.get("SPLASH_DIST_BACKEND") or "nccl") == "nccl"


def load_tokenizer(model_dir: str):
    """The checkpoint's Hugging Face tokenizer, or None (token ids only)."""
    if not any(os.path.exists(os.path.join(model_dir, f))
               for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    try:
        from transformers import AutoTokenizer  # optional and slow to import: only when needed
    except ImportError:
        logger.warning("the checkpoint has a tokenizer, but transformers is not installed: "
                       "token-id prompts only (pip install 'splash-serve[tokenizer]' for "
                       "text prompts and chat)")
        return None
    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except Exception as e:  # a checkpoint without a usable tokenizer: token ids only
        logger.warning("tokenizer files present but not loadable (%s); token ids only", e)
        return None
