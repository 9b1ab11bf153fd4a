"""What a worker needs to start (picklable; imports nothing heavy)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerConfig:
    model: str  # checkpoint dir
    rank: int
    world: int
    backend: str  # resolved backend name
    dtype: str  # weights/activations
    kv_dtype: str
    index_dtype: str  # DSA indexer keys (unused by other models)
    page_size: int
    layout: str  # layout at start
    dist_init: str = ""  # torch.distributed init method ("" with world == 1; "env://")
    cuda_graphs: bool = False  # replay decode steps from CUDA graphs (splash/engine/graphs.py)
    resident_heads: bool = False  # hold every layout's projection heads from the start
    graph_max_batch: int = 256  # largest padded decode batch (per rank for DP/DOP) captured
    graph_layouts: tuple[str, ...] = ()  # layouts whose graphs are captured at start-up
    graph_context: int = 1024  # start-up graphs cover decode steps up to this context
    max_model_len: int = 0  # longest history a step may attend (DSA kernels compile up to it)
    # the profiling steps run before the KV pool is sized (splash/engine/memory_plan.py):
    # a prefill of profile_prefill_rows rows and a decode of profile_decode_rows rows (each
    # sampled), both at context profile_context
    profile_prefill_rows: int = 0
    profile_decode_rows: int = 0
    profile_context: int = 0
