"""A worker: one device's model shard, KV pools and layouts; executes step plans.

Runs in-process (T=1) or as a spawned process talking to the controller over ZeroMQ
(`worker_loop.worker_main`). Under torchrun (multi-node) the loop starts from
`python -m splash.engine.worker_loop`, taking rank and rendezvous from torchrun's environment.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field

import msgspec
import torch
import torch.distributed as dist
from torch.profiler import record_function

from splash import envs
from splash.backends import get_backend
from splash.backends.dtypes import torch_dtype
from splash.core.ownership import fitting_layouts, get_layout, heads_held
from splash.core.protocol import (
    WORKER_PROTOCOL_VERSION,
    StepPlan,
    StepResult,
    TokenLogprobs,
    WorkerProfile,
    WorkerReady,
)
from splash.dist.comm import Comm
from splash.dist.host_copy import to_device
from splash.dist.rendezvous import join_group
from splash.engine.graphs import DecodeGraphs, graph_width, startup_layouts
from splash.engine.kv_pools import build_store
from splash.engine.profiling import (
    PROFILE_PAGES,
    profile_context,
    profile_plans,
    profile_tables,
)
from splash.engine.sampling import (
    greedy_draws,
    num_draws,
    prompt_logprobs,
    sample_step,
    split_greedy,
)
from splash.engine.startup_graphs import capture_startup
from splash.engine.step_profile import StepProfiler
from splash.engine.worker_config import WorkerConfig
from splash.kernels_triton import set_value_checks
from splash.layouts.base import AttentionLayout, KVStore, StepMeta
from splash.layouts.expanded import warm_expanded
from splash.layouts.registry import make_layouts
from splash.layouts.sparse import warm_selection
from splash.logging_utils import get_logger
from splash.model import overlap
from splash.model.config import ModelConfig
from splash.model.loader import CheckpointWeights
from splash.model.mlp import MoE
from splash.model.model import MLAModel
from splash.switching.executor import PreCopy, SwitchExecutor

logger = get_logger("splash.worker")


@dataclass
class Launched:
    """A step issued to the device and not waited for (`Worker.launch`); `Worker.finish` makes
    its result. ``result`` is set already where the step completed on the host (weight loads,
    the CPU)."""

    plan: StepPlan
    t0: float
    result: StepResult | None = None
    tokens: torch.Tensor | None = None  # rank 0: the draws (a host copy in flight on GPUs)
    done: torch.cuda.Event | None = None  # recorded after the step's last kernel
    switch: SwitchExecutor | None = None
    graph_step: bool = False
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[list[TokenLogprobs]] = field(default_factory=list)

    def ready(self) -> bool:
        """Whether ``finish`` would return without waiting for the device."""
        return self.result is not None or self.done is None or self.done.query()


class Worker:
    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.backend = get_backend(cfg.backend)
        self.device = self.backend.device(cfg.rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            # the engine builds every kernel input itself: skip the launchers' value checks,
            # which read tensors back to the host and would sync the device every layer
            set_value_checks(False)
        if cfg.world > 1:
            # liveness comes from the controller's step timeouts; torch's heartbeat monitor only
            # prints C++ stacks when rank 0 (the rendezvous store) exits first at shutdown
            os.environ.setdefault("TORCH_NCCL_ENABLE_MONITORING", "0")
            join_group(envs.get("SPLASH_DIST_BACKEND") or self.backend.dist_backend,
                       cfg.dist_init, cfg.rank, cfg.world)
        self.comm = Comm(cfg.rank, cfg.world)
        self.comm.connect(self.device)
        self.comm.enable_fast_sum(self.device, torch_dtype(cfg.dtype))
        num_heads = ModelConfig.from_hf(cfg.model).num_attention_heads

        def held(layout: str) -> range:
            return heads_held(get_layout(layout), cfg.rank, cfg.world, num_heads)

        heads = held(cfg.layout)
        # resident: every layout's head range loaded now, so switches move no weights
        others = {held(name) for name in fitting_layouts(num_heads, cfg.world)} - {heads} \
            if cfg.resident_heads else set()
        self.model = MLAModel.from_pretrained(
            cfg.model, cfg.rank, cfg.world, heads.start, len(heads),
            dtype=torch_dtype(cfg.dtype), device=self.device,
            also_hold=sorted(others, key=lambda r: r.start))
        overlap.enable(self.device)
        moe_config = self.backend.kernel_config("fused_moe") or None
        for layer in self.model.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.kernel_config = moe_config
        self.held = held  # the head range a layout places on this rank
        self.weight_bytes = self._held_bytes()  # weights and whatever else loading left
        self.tables: dict[str, list[int]] = {}
        self.precopy: PreCopy | None = None  # a background switch's transfer in flight
        self.graphs: DecodeGraphs | None = None
        self.capture = cfg.cuda_graphs and self.device.type == "cuda"
        for attn in self.model.attn_layers:  # graphs read the placed weights' addresses
            attn.keep_placements = self.capture or cfg.resident_heads
        self.num_pages = 0
        self.store: KVStore
        self.layouts: dict[str, AttentionLayout] = {}
        oom = envs.get("SPLASH_TEST_OOM_STEP")
        self.oom_step = int(oom) if oom and cfg.rank == 0 else None
        self.samples: tuple[int, torch.Tensor] | None = None  # (step, its draws on the device)
        self.failed_step = -1  # the last step that failed here
        self.profiler = StepProfiler(cfg.rank, self.device)

    def _held_bytes(self) -> int:
        """Device memory this process holds (0 on the CPU, where nothing reports it: the
        controller then counts the memory model's weights)."""
        if self.device.type != "cuda":
            return 0
        self.backend.synchronize()
        return torch.cuda.memory_allocated(self.device)

    def _build_store(self, num_pages: int) -> None:
        """KV pools of ``num_pages`` pages per layer and the layouts that read them."""
        self.store = build_store(self.model.cfg, self.backend, self.device, num_pages,
                                 self.cfg.page_size, self.cfg.kv_dtype, self.cfg.index_dtype)
        self.layouts = make_layouts(self.comm, self.store, self.model.cfg.kv_lora_rank)
        self.num_pages = num_pages

    @torch.inference_mode()
    def profile(self) -> tuple[int, int]:
        """Run the profiling steps (`splash.engine.profiling`) over a one-page pool and return
        (peak activation bytes of all of them, of the decode step alone) above the weights;
        (0, 0) where the device does not report its peak (the CPU). Raises
        torch.OutOfMemoryError when a step does not fit."""
        cfg, cuda = self.cfg, self.device.type == "cuda"
        self._build_store(PROFILE_PAGES)
        peaks = []
        try:
            for plan in profile_plans(cfg.layout, cfg.world, cfg.profile_prefill_rows,
                                      cfg.profile_decode_rows, cfg.profile_context):
                if cuda:
                    self.backend.synchronize()
                    torch.cuda.reset_peak_memory_stats(self.device)
                base = self._held_bytes()
                self.tables = profile_tables(plan, cfg.rank, cfg.world, cfg.page_size)
                self._forward(plan, None, graphs=False)
                self.backend.synchronize()
                peaks.append(torch.cuda.max_memory_allocated(self.device) - base if cuda else 0)
        finally:
            self.tables = {}
            self._build_store(0)  # free the profiling pool before the real one is sized
            if cuda:
                torch.cuda.empty_cache()
        peak = max(peaks, default=0)
        decode = peaks[-1] if cfg.profile_decode_rows and peaks else 0
        if cuda:
            logger.info("rank %d: profiling steps (prefill %d rows, decode %d rows, context %d) "
                        "peak %.2f GiB above %.2f GiB of weights", cfg.rank,
                        cfg.profile_prefill_rows, cfg.profile_decode_rows,
                        profile_context(cfg.profile_context),
                        peak / 2**30, self.weight_bytes / 2**30)
        return peak, decode

    def profile_report(self) -> WorkerProfile:
        """The start-up report: weights held, and the profiling steps' peaks on GPUs (the CPU
        reports no memory: the controller counts the estimates)."""
        peak = decode = 0
        if self.device.type == "cuda" and self.cfg.profile_prefill_rows:
            try:
                peak, decode = self.profile()
            except torch.OutOfMemoryError as e:
                return WorkerProfile(self.cfg.rank, os.getpid(), str(self.device),
                                     error=f"OutOfMemoryError: {e}", oom=True)
        return WorkerProfile(self.cfg.rank, os.getpid(), str(self.device), self.weight_bytes,
                             peak, decode)

    def recover(self) -> None:
        """After a step's out-of-memory error (`recoverable`): return the cached blocks."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def allocate(self, num_pages: int) -> WorkerReady:
        """Allocate the KV pool the controller sized, then capture the start-up CUDA graphs."""
        self._build_store(num_pages)
        if self.device.type == "cuda":  # DSA: compile for every history now, not mid-serving
            t0 = time.perf_counter()
            with torch.inference_mode():
                n = warm_selection(self.store, self.model.attn_layers, self.cfg.max_model_len,
                                   self.cfg.world)
            if n:
                logger.info("rank %d: DSA selection kernels ready for histories up to %d tokens "
                            "(%d launches, %.1f s)", self.cfg.rank, self.cfg.max_model_len, n,
                            time.perf_counter() - t0)
            with torch.inference_mode():  # the expanded prefill's pieces of long histories
                warm_expanded(self.model.attn_layers[0], self.device)
        ready = WorkerReady(self.cfg.rank, os.getpid(), num_pages, str(self.device))
        if not (self.capture or envs.get("SPLASH_PAD_DECODE") == "1"):
            return ready
        width = graph_width(self.cfg.graph_context, self.cfg.page_size) if self.capture else 1
        self.graphs = DecodeGraphs(self._model_forward, self.comm, self.cfg.page_size,
                                   self.device, self.cfg.graph_max_batch, capture=self.capture,
                                   min_width=width, input_ids=self._input_ids)
        if not self.capture:
            return ready
        names = startup_layouts(self.cfg.graph_layouts, self.cfg.layout, self.cfg.world,
                                self.cfg.resident_heads)
        n, secs, used = capture_startup(self.graphs, self.layouts, self.comm, self.device,
                                        self.cfg.rank, self.cfg.world, names, width, self.held,
                                        self._use_heads, self.held(self.cfg.layout))
        return msgspec.structs.replace(ready, graphs=n, graph_s=secs, graph_bytes=used)

    def _use_heads(self, heads: range) -> None:
        """Compute with the held placement of ``heads`` (a no-op where it is the current)."""
        for attn in self.model.attn_layers:
            if range(attn.head_start, attn.head_start + attn.num_heads) != heads:
                attn.use(heads)

    def _apply_tables(self, plan: StepPlan) -> None:
        for rid in plan.released:
            self.tables.pop(rid, None)
        for up in plan.table_updates:
            table = self.tables.setdefault(up.request_id, [])
            del table[up.start:]
            table.extend(up.pages)

    @torch.inference_mode()
    def load_weights(self, weights: Mapping[str, torch.Tensor], names: list[str]) -> None:
        """Copy new values of ``names`` into the model in place (every placement it holds)."""
        unused = self.model.load_weights(weights, names)
        if unused:
            raise ValueError(f"the model holds no tensor {unused[0]!r}")
        self.backend.synchronize()

    def execute(self, plan: StepPlan) -> StepResult:
        return self.finish(self.launch(plan))

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> Launched:
        """Issue ``plan``'s step without waiting for the device: the next plan may be launched
        behind it (its inputs may read this step's draws) before `finish` collects it."""
        if plan.profile or self.profiler.prof is not None:
            self.profiler.before(plan)
        try:
            label = (record_function(f"step {plan.step} launch")  # the profile's timeline
                     if self.profiler.prof is not None else nullcontext())
            with label:
                return self._launch(plan)
        except Exception:
            self.samples, self.failed_step = None, plan.step
            raise

    def _launch(self, plan: StepPlan) -> Launched:
        t0 = time.perf_counter()
        if plan.load_weights is not None:
            weights = CheckpointWeights(plan.load_weights.path, self.model.cfg)
            self.load_weights(weights, plan.load_weights.names)
            return Launched(plan, t0, StepResult(
                version=WORKER_PROTOCOL_VERSION, step=plan.step, rank=self.cfg.rank,
                elapsed_ms=(time.perf_counter() - t0) * 1e3))
        self._apply_tables(plan)
        switch = self._switch(plan)
        if switch is None or not switch.plan.hooks_forward:  # nothing still moving: copy now,
            self.store.copy_pages(plan.page_copies)  # before anything writes into the copies
        out = Launched(plan, t0, switch=switch)
        self.graph_step = False
        if plan.input_ids:
            drawn, out.logprobs, out.prompt_logprobs = self._forward(plan, switch)
            out.tokens = self._keep_samples(plan, drawn)
            out.graph_step = self.graph_step
        elif switch is not None:  # nothing to compute: complete every layer's transfer
            for layer in range(self.model.cfg.num_hidden_layers):
                switch.before_layer(layer)
        if self.device.type == "cuda":
            out.done = torch.cuda.Event()
            out.done.record()
        return out

    def finish(self, out: Launched) -> StepResult:
        """Wait for a launched step and make its result."""
        if out.result is not None:
            return out.result
        if out.done is not None:  # the step's stream waited for every transfer it used
            out.done.synchronize()
        if out.switch is not None and not self.comm.stream_ordered:
            self.backend.synchronize()  # gloo's device copies: not ordered with the stream
        switch = out.switch
        return StepResult(
            version=WORKER_PROTOCOL_VERSION, step=out.plan.step, rank=self.cfg.rank,
            tokens=out.tokens.tolist() if out.tokens is not None and self.cfg.rank == 0 else [],
            logprobs=out.logprobs, prompt_logprobs=out.prompt_logprobs,
            elapsed_ms=(time.perf_counter() - out.t0) * 1e3,
            switch_ms=switch.busy_ms if switch else 0.0,
            switch_device_ms=switch.device_ms() if switch else None, graph_replay=out.graph_step,
            kv_bytes_received=switch.kv_bytes if switch else 0,
            weight_bytes_received=switch.weight_bytes if switch else 0,
            precopy_done=self.precopy is None or self.precopy.done())

    def _keep_samples(self, plan: StepPlan, drawn: torch.Tensor | None) -> torch.Tensor | None:
        """Keep the step's draws on the device for the next step's inputs; rank 0's host copy,
        issued now."""
        self.samples = (plan.step, drawn) if drawn is not None else None
        if drawn is None or self.cfg.rank != 0:
            return None
        if self.device.type != "cuda":
            return drawn
        host = torch.empty(drawn.shape, dtype=drawn.dtype, pin_memory=True)
        return host.copy_(drawn, non_blocking=True)

    def _input_ids(self, ids: list[int], plan: StepPlan) -> torch.Tensor:
        """The step's input ids on the device; ids < 0 are the previous step's draws."""
        dev = to_device(torch.tensor(ids, dtype=torch.long), self.device)
        if plan.inputs_from_step < 0:
            return dev
        if self.failed_step == plan.inputs_from_step:
            raise PreviousStepFailed(f"step {plan.step} reads the draws of step "
                                     f"{plan.inputs_from_step}, which failed")
        if self.samples is None or self.samples[0] != plan.inputs_from_step:
            raise RuntimeError(f"step {plan.step} reads the draws of step "
                               f"{plan.inputs_from_step}, which this rank does not hold "
                               f"(it holds step {self.samples[0] if self.samples else None}'s)")
        prev = self.samples[1]
        return torch.where(dev < 0, prev[(-dev - 1).clamp(0, max(prev.numel() - 1, 0))], dev)

    def _switch(self, plan: StepPlan) -> SwitchExecutor | None:
        """Start this step's part of a switch; the executor when the step computes in the
        destination, None when it computes in the source (no switch, pre-copy, cancel)."""
        sp = plan.switch
        if sp is None:
            return None
        attns = self.model.attn_layers
        if sp.mode == "precopy":
            if self.precopy is not None:
                raise RuntimeError("a pre-copy is already in flight")
            self.precopy = PreCopy(sp, self.comm, self.store, attns, self.device)
            return None
        staged, self.precopy = self.precopy, None
        if sp.mode == "cancel":
            if staged is not None:
                staged.cancel()
            return None
        if (sp.mode == "handoff") != (staged is not None):
            raise RuntimeError(f"switch {sp.mode} {'without' if staged is None else 'during'} "
                               "a pre-copy")
        with record_function(f"switch {sp.mode} start"):
            switch = SwitchExecutor(sp, self.comm, self.store, attns, self.device, staged=staged)
            switch.start()
        return switch

    def _model_forward(self, ids: torch.Tensor, meta: StepMeta, impl: AttentionLayout,
                       switch: SwitchExecutor | None = None) -> torch.Tensor:
        def attn_fn(layer: int, attn, h: torch.Tensor) -> torch.Tensor:
            if switch is not None and switch.plan.hooks_forward:  # a copied page may have
                switch.before_layer(layer)  # arrived with this layer's transfer
                self.store.copy_pages(meta.plan.page_copies, range(layer, layer + 1))
            return impl.forward(layer, attn, h, meta)

        return self.model.forward(ids, meta.positions, attn_fn, self.comm.sum_partials)

    def _forward(self, plan: StepPlan, switch: SwitchExecutor | None, graphs: bool = True
                 ) -> tuple[torch.Tensor | None, list[TokenLogprobs], list[list[TokenLogprobs]]]:
        if plan.step == self.oom_step:  # fault injection for the tests (splash/envs.py)
            raise torch.OutOfMemoryError(f"SPLASH_TEST_OOM_STEP: step {plan.step} "
                                         "(injected)")
        impl = self.layouts[plan.layout]
        hidden = None
        if graphs and self.graphs is not None and (switch is None or
                                                   not switch.plan.hooks_forward):
            hidden = self.graphs.run(plan, self.tables, impl)
            self.graph_step = hidden is not None and self.graphs.capture
        if hidden is None:
            meta = StepMeta(plan, self.tables, self.cfg.rank, self.cfg.world,
                            self.cfg.page_size, self.device)
            ids = self._input_ids(plan.input_ids, plan)
            hidden = self._model_forward(ids, meta, impl, switch)
        return self._draw(plan, hidden)

    def _draw(self, plan: StepPlan, hidden: torch.Tensor
              ) -> tuple[torch.Tensor | None, list[TokenLogprobs], list[list[TokenLogprobs]]]:
        """The step's draws (on every rank where the plan shares them: drawn together from
        vocabulary slices when all greedy, else rank 0's through an all-reduce), and rank 0's
        logprobs and prompt logprobs."""
        rank0 = self.cfg.rank == 0
        shared = plan.share_samples and self.cfg.world > 1
        if shared and split_greedy(plan):
            together = greedy_draws(self.model, hidden, plan, self.cfg.rank, self.cfg.world,
                                    self.comm.all_gather_same)
            return together, [], prompt_logprobs(self.model, hidden, plan) if rank0 else []
        drawn, logprobs, prompt = sample_step(self.model, hidden, plan) if rank0 \
            else (None, [], [])
        if shared:
            if drawn is None:  # ranks > 0 (or a step that draws nothing: every rank knows)
                drawn = torch.zeros(num_draws(plan), dtype=torch.long, device=self.device)
            if drawn.numel():
                self.comm.all_reduce(drawn)  # rank 0's draws, zeros elsewhere
        return drawn, logprobs, prompt

    def shutdown(self) -> None:
        self.profiler.stop()  # a profile still running is written now
        if self.cfg.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


class PreviousStepFailed(RuntimeError):
    """A step scheduled ahead reads the draws of a step that failed: it fails the same way."""


def recoverable(error: BaseException, plan: StepPlan, world: int) -> bool:
    """Whether a worker serves on after ``error`` in ``plan``: an out-of-memory error (the
    allocator unwound it) of a single-rank group (no peer waits in a collective) in a plain
    step (no switch or weight load half done), or a step scheduled ahead on such a step. Only
    the step's requests fail."""
    return isinstance(error, (torch.OutOfMemoryError, PreviousStepFailed)) and world == 1 \
        and plan.switch is None and plan.load_weights is None


