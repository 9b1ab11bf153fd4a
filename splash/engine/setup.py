"""Engine start-up: resolve the backend, read the model, size the KV pool per layout, start the
workers. The KV pool is sized for the layouts with sharded projections; under a layout with
replicated projections the replicas' bytes are held back as reserved pages (DESIGN §1)."""

from __future__ import annotations

import math
import os

from splash import envs
from splash.backends import get_backend
from splash.core.allocator import RankAllocators
from splash.core.memory import MemoryModel
from splash.core.ownership import LAYOUTS, KVPlacement, Layout, fitting_layouts, get_layout
from splash.engine.config import EngineConfig
from splash.engine.executor import ExternalExecutor, InprocExecutor, MPExecutor
from splash.engine.scheduler import Scheduler, SchedulerConfig
from splash.engine.worker_config import WorkerConfig
from splash.errors import ConfigError, LayoutInfeasibleError
from splash.logging_utils import get_logger
from splash.model.config import ModelConfig

logger = get_logger("splash.engine")

_CPU_MAX_PAGES = 4096  # the CPU pool serves tests and demos; keep it small


class EngineSetup:
    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        if not os.path.isfile(os.path.join(cfg.model, "config.json")):
            raise ConfigError(f"{cfg.model!r} is not a checkpoint dir (no config.json)")
        self.model_cfg = ModelConfig.from_hf(cfg.model)
        backend = get_backend(cfg.backend)
        self.backend_name = backend.name
        self.link_gbps = backend.profile.link_gbps  # predicts switch transfer times
        on_cpu = backend.name == "cpu"
        # refused here, before any worker starts: a dtype the backend computes wrongly, a KV
        # dtype the kernels cannot read beside the activations
        default = "fp32" if on_cpu else "bf16"
        self.dtype, self.kv_dtype = backend.check_dtypes(cfg.dtype or default, cfg.kv_dtype)
        self.page_size = cfg.page_size or (16 if on_cpu else 64)
        world = cfg.tp_size
        fits = fitting_layouts(self.model_cfg.num_attention_heads, world)
        self.fitting = fits
        self.initial_layout = self._initial_layout(fits)
        self.memory = MemoryModel(self.model_cfg, world, self.dtype, self.kv_dtype,
                                  self.page_size)
        self.num_pages = cfg.kv_pages_per_rank or self._pages_from_memory(backend, on_cpu)
        extra = self.memory.projection_bytes_per_rank(LAYOUTS["dp"]) - \
            self.memory.projection_bytes_per_rank(LAYOUTS["tp"])
        # an explicit pool size is the KV pool alone; a derived one lends replica bytes to KV
        derived = cfg.kv_pages_per_rank is None
        self.replica_pages = math.ceil(extra / self.memory.page_bytes) if world > 1 and derived else 0
        if self.replica_pages >= self.num_pages:
            self.fitting = [n for n in fits if LAYOUTS[n].shards_heads]
            if not get_layout(self.initial_layout).shards_heads:
                raise LayoutInfeasibleError(
                    f"layout {self.initial_layout} replicates projections, which leaves no KV "
                    f"pages; layouts that fit: {self.fitting}")
        self.max_model_len = cfg.max_model_len or self.model_cfg.max_position_embeddings
        limit = self.model_cfg.max_dense_context
        if limit is not None and self.max_model_len > limit:
            logger.warning("DSA model: dense attention is exact only up to index_topk=%d "
                           "tokens; max_model_len capped there", limit)
            self.max_model_len = limit
        per_rank_tokens = (self.num_pages - self.replica_pages) * self.page_size
        self.max_request_tokens = per_rank_tokens  # an owned history must fit one rank
        self.allocators = RankAllocators(world, self.num_pages)
        layout = get_layout(self.initial_layout)
        self.allocators.set_reserved(self.reserved_pages(layout))
        sched_cfg = SchedulerConfig(
            world=world, page_size=self.page_size, max_model_len=self.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens or (256 if on_cpu else 2048),
            enable_chunked_prefill=cfg.enable_chunked_prefill,
            enable_prefix_caching=cfg.enable_prefix_caching)
        self.scheduler = Scheduler(sched_cfg, self.allocators, layout)
        logger.info("engine: %s on %s x%d, layout %s, %d KV pages/rank of %d tokens "
                    "(%d reserved under replicated projections)", self.model_cfg.model_type,
                    backend.name, world, self.initial_layout, self.num_pages, self.page_size,
                    self.replica_pages)

    def _initial_layout(self, fits: list[str]) -> str:
        want = self.cfg.layout
        if want == "auto":
            return "tp" if "tp" in fits else "dp"
        if want not in fits:
            raise LayoutInfeasibleError(
                f"layout {want!r} shards {self.model_cfg.num_attention_heads} heads over "
                f"{self.cfg.tp_size} ranks, which does not divide; layouts that fit: {fits}")
        return want

    def _pages_from_memory(self, backend, on_cpu: bool) -> int:
        budget = self._budget_bytes(backend, on_cpu)
        pages = self.memory.kv_pages_per_rank(LAYOUTS["dop"], budget)
        # never more than the scheduler could ever fill: every sequence at max_model_len
        max_len = self.cfg.max_model_len or self.model_cfg.max_position_embeddings
        pages = min(pages, -(-max_len // self.page_size) * self.cfg.max_num_seqs)
        if on_cpu:
            pages = min(pages, _CPU_MAX_PAGES)
        if pages < 1:
            raise LayoutInfeasibleError(
                f"the model's weights leave no KV memory at memory_fraction "
                f"{self.cfg.memory_fraction} on {backend.profile_name}")
        return pages

    def _budget_bytes(self, backend, on_cpu: bool) -> int:
        """memory_fraction of the device, minus what others already use there (like vLLM's
        gpu_memory_utilization), split among the ranks that share one device."""
        total = backend.profile.memory_gib * 2**30
        if on_cpu:
            return int(total * self.cfg.memory_fraction)
        import torch

        free, total = torch.cuda.mem_get_info(0)
        sharing = max(1, -(-self.cfg.tp_size // max(torch.cuda.device_count(), 1)))
        used_by_others = total - free
        return int((total * self.cfg.memory_fraction - used_by_others) / sharing)

    def reserved_pages(self, layout: Layout) -> int:
        return 0 if layout.shards_heads else self.replica_pages

    def kv_capacity_tokens(self) -> dict[str, int]:
        out = {}
        for name, layout in LAYOUTS.items():
            pages = max(self.num_pages - self.reserved_pages(layout), 0)
            per_rank = pages * self.page_size
            world = 1 if layout.kv is KVPlacement.REPLICATED else self.cfg.tp_size
            out[name] = per_rank * world if name in self.fitting else 0
        return out

    def worker_config(self) -> WorkerConfig:
        return WorkerConfig(model=self.cfg.model, rank=0, world=self.cfg.tp_size,
                            backend=self.backend_name, dtype=self.dtype, kv_dtype=self.kv_dtype,
                            page_size=self.page_size, num_pages=self.num_pages,
                            layout=self.initial_layout, cuda_graphs=self.cuda_graphs,
                            graph_max_batch=min(self.cfg.max_num_seqs, 512))

    @property
    def cuda_graphs(self) -> bool:
        """Decode steps from CUDA graphs: on CUDA unless enforce_eager; at T>1 only over NCCL
        (gloo collectives, used to run several ranks on one GPU, cannot be captured)."""
        if self.backend_name != "cuda" or self.cfg.enforce_eager:
            return False
        return self.cfg.tp_size == 1 or (envs.get("SPLASH_DIST_BACKEND") or "nccl") == "nccl"

    def start_executor(self):
        wcfg = self.worker_config()
        if self.cfg.worker_addr:
            return ExternalExecutor(wcfg, self.cfg.worker_addr)
        # CPU workers always get their own process, where the Triton interpreter is switched on
        # before anything imports Triton (splash.engine.executor says why)
        if self.cfg.tp_size == 1 and self.backend_name != "cpu":
            return InprocExecutor(wcfg)
        return MPExecutor(wcfg)

    def load_tokenizer(self):
        if not any(os.path.exists(os.path.join(self.cfg.model, f))
                   for f in ("tokenizer.json", "tokenizer_config.json")):
            return None
        try:
            from transformers import AutoTokenizer
        except ImportError:
            logger.warning("the checkpoint has a tokenizer, but transformers is not installed: "
                           "token-id prompts only (pip install 'splash-serve[tokenizer]' for "
                           "text prompts and chat)")
            return None
        try:
            return AutoTokenizer.from_pretrained(self.cfg.model)
        except Exception as e:  # a checkpoint without a usable tokenizer: token ids only
            logger.warning("tokenizer files present but not loadable (%s); token ids only", e)
            return None

