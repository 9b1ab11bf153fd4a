"""A worker's KV pools: the latent rows of every layer (+ fp8 scales) and, for DSA models, the
indexer keys of the indexer layers in the same pages, with the kernel configs the layouts
launch with."""

from __future__ import annotations

import torch

from splash.backends import BaseBackend
from splash.backends.dtypes import torch_dtype
from splash.layouts.base import KVStore
from splash.model.config import ModelConfig

# the kernels whose backend configs the layouts pass
KERNELS = ("mla_decode", "mla_sparse", "mla_extend", "index_scores", "topk")


def build_store(mcfg: ModelConfig, backend: BaseBackend, device: torch.device, num_pages: int,
                page_size: int, kv_dtype: str, index_dtype: str) -> KVStore:
    """Pools of ``num_pages`` pages of ``page_size`` tokens per layer. Each kind of pool is
    allocated for all layers at once, so a switch packs them in one launch."""
    dtype = torch_dtype(kv_dtype, backend.fp8_dtype)
    shape = (num_pages, page_size, mcfg.kv_dim)
    layers = mcfg.num_hidden_layers
    caches = list(torch.zeros((layers, *shape), dtype=dtype, device=device))
    scales = None
    if dtype.itemsize == 1:
        scales = list(torch.ones((layers, *shape[:2]), dtype=torch.float32, device=device))
    keys, key_scales = _index_pools(mcfg, backend, device, num_pages, page_size, index_dtype)
    configs = {k: backend.kernel_config(k) for k in KERNELS}
    return KVStore(caches, scales, configs, keys, key_scales)


def _index_pools(mcfg: ModelConfig, backend: BaseBackend, device: torch.device,
                 num_pages: int, page_size: int, index_dtype: str) -> tuple[list, list]:
    """DSA: per indexer layer, the indexer keys (P, PS, I) in the same pages as the latent
    rows (+ one fp32 scale per key when fp8); None in the other layers."""
    layers = range(mcfg.num_hidden_layers)
    if not mcfg.is_dsa:
        return [None for _ in layers], [None for _ in layers]
    dtype = torch_dtype(index_dtype, backend.fp8_dtype)
    shape = (num_pages, page_size, int(mcfg.index_head_dim or 0))
    keys = [torch.zeros(shape, dtype=dtype, device=device)
            if mcfg.has_indexer(i) else None for i in layers]
    scales = [torch.ones(shape[:2], dtype=torch.float32, device=device)
              if k is not None and dtype.itemsize == 1 else None for k in keys]
    return keys, scales
