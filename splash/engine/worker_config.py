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
    num_pages: int  # physical KV pages of this rank
    layout: str  # layout at start
    dist_init: str = ""  # torch.distributed init method ("" with world == 1; "env://")
    cuda_graphs: bool = False  # replay decode steps from CUDA graphs (splash/engine/graphs.py)
    graph_max_batch: int = 256  # largest padded decode batch (per rank for DP/DOP) captured
