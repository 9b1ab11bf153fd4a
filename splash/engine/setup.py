"""Engine start-up, resolved once: backend, model, dtypes, the KV pool per layout, limits.

`resolve_setup(cfg)` reads the checkpoint's config and the device's memory and returns a frozen
`EngineSetup`; it changes nothing (CPU workers get the Triton interpreter in their own processes:
`splash.engine.executor`). The KV pool is sized for the layouts with sharded projections; under
a layout with replicated projections the replicas' bytes are held back as reserved pages.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from splash import envs
from splash.backends import BaseBackend, HardwareProfile, get_backend
from splash.core.allocator import RankAllocators
from splash.core.memory import MemoryModel
from splash.core.ownership import LAYOUTS, Layout, fitting_layouts, get_layout, kv_capacity_tokens
from splash.engine.config import EngineConfig
from splash.engine.scheduler import Scheduler, SchedulerConfig
from splash.engine.worker_config import WorkerConfig
from splash.errors import ConfigError, LayoutInfeasibleError
from splash.logging_utils import get_logger
from splash.model.config import ModelConfig

logger = get_logger("splash.engine")

_CPU_MAX_PAGES = 4096  # the CPU pool serves tests and demos; keep it small


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
    replica_pages: int  # pages held back while projections are replicated
    max_model_len: int
    max_request_tokens: int  # an owned history must fit one rank
    cuda_graphs: bool

    @property
    def world(self) -> int:
        return self.cfg.tp_size

    def reserved_pages(self, layout: Layout) -> int:
        return 0 if layout.shards_heads else self.replica_pages

    def kv_capacity_tokens(self) -> dict[str, int]:
        return {name: kv_capacity_tokens(layout, self.num_pages - self.reserved_pages(layout),
                                         self.page_size, self.world)
                if name in self.fitting else 0 for name, layout in LAYOUTS.items()}

    def worker_config(self) -> WorkerConfig:
        return WorkerConfig(model=self.cfg.model, rank=0, world=self.world,
                            backend=self.backend_name, dtype=self.dtype, kv_dtype=self.kv_dtype,
                            index_dtype=self.index_dtype, page_size=self.page_size, num_pages=self.num_pages,
                            layout=self.initial_layout, cuda_graphs=self.cuda_graphs,
                            graph_max_batch=min(self.cfg.max_num_seqs, 512))


def resolve_setup(cfg: EngineConfig) -> EngineSetup:
    """Backend, model config, dtypes, layouts that fit, KV pages per rank and request limits."""
    if not os.path.isfile(os.path.join(cfg.model, "config.json")):
        raise ConfigError(f"{cfg.model!r} is not a checkpoint dir (no config.json)")
    model_cfg = ModelConfig.from_hf(cfg.model)
    backend = get_backend(cfg.backend)
    on_cpu = backend.name == "cpu"
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
    num_pages = cfg.kv_pages_per_rank or _pages_from_memory(cfg, model_cfg, memory, backend)
    # an explicit pool size is the KV pool alone; a derived one lends replica bytes to KV
    extra = memory.projection_bytes_per_rank(LAYOUTS["dp"]) - \
        memory.projection_bytes_per_rank(LAYOUTS["tp"])
    derived = cfg.kv_pages_per_rank is None
    replica_pages = math.ceil(extra / memory.page_bytes) if world > 1 and derived else 0
    if replica_pages >= num_pages:
        fitting = [n for n in fitting if LAYOUTS[n].shards_heads]
        if not get_layout(initial).shards_heads:
            raise LayoutInfeasibleError(
                f"layout {initial} replicates projections, which leaves no KV pages; layouts "
                f"that fit: {fitting}")
    max_model_len = cfg.max_model_len or model_cfg.max_position_embeddings
    logger.info("engine: %s on %s x%d, layout %s, %d KV pages/rank of %d tokens "
                "(%d reserved under replicated projections)", model_cfg.model_type,
                backend.name, world, initial, num_pages, page_size, replica_pages)
    return EngineSetup(
        cfg=cfg, model_cfg=model_cfg, backend_name=backend.name, profile=backend.profile,
        dtype=dtype, kv_dtype=kv_dtype, index_dtype=index_dtype, page_size=page_size,
        memory=memory,
        fitting=tuple(fitting), initial_layout=initial, num_pages=num_pages,
        replica_pages=replica_pages, max_model_len=max_model_len,
        max_request_tokens=(num_pages - replica_pages) * page_size,
        cuda_graphs=_cuda_graphs(cfg, backend.name))


def build_scheduler(setup: EngineSetup) -> Scheduler:
    """The page allocators (reserving the initial layout's replica pages) and the scheduler."""
    cfg, world = setup.cfg, setup.world
    allocators = RankAllocators(world, setup.num_pages)
    layout = get_layout(setup.initial_layout)
    allocators.set_reserved(setup.reserved_pages(layout))
    sched_cfg = SchedulerConfig(
        world=world, page_size=setup.page_size, max_model_len=setup.max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens or (
            256 if setup.backend_name == "cpu" else 2048),
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
        return "tp" if "tp" in fits else "dp"
    if cfg.layout not in fits:
        raise LayoutInfeasibleError(
            f"layout {cfg.layout!r} shards {model_cfg.num_attention_heads} heads over "
            f"{cfg.tp_size} ranks, which does not divide; layouts that fit: {fits}")
    return cfg.layout


def _pages_from_memory(cfg: EngineConfig, model_cfg: ModelConfig, memory: MemoryModel,
                       backend: BaseBackend) -> int:
    on_cpu = backend.name == "cpu"
    pages = memory.kv_pages_per_rank(LAYOUTS["dop"], _budget_bytes(cfg, backend))
    # never more than the scheduler could ever fill: every sequence at max_model_len
    max_len = cfg.max_model_len or model_cfg.max_position_embeddings
    pages = min(pages, -(-max_len // memory.page_size) * cfg.max_num_seqs)
    if on_cpu:
        pages = min(pages, _CPU_MAX_PAGES)
    if pages < 1:
        raise LayoutInfeasibleError(
            f"the model's weights leave no KV memory at memory_fraction "
            f"{cfg.memory_fraction} on {backend.profile_name}")
    return pages


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
