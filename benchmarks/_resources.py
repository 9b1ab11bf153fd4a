"""What the compiler gave each Triton kernel compiled so far in this process: registers a
thread, spilled bytes, shared memory a program, warps and stages, and from those the programs
an SM can hold (registers and shared memory, whichever binds first)."""

from __future__ import annotations

import inspect
import sys

import torch
import triton


def _compiled(fn) -> list:
    out = []
    for entry in getattr(fn, "device_caches", {}).values():
        cache = entry[0] if isinstance(entry, tuple) else entry
        out += list(cache.values()) if isinstance(cache, dict) else []
    return out


def compiled_resources(dev: torch.device) -> list[dict]:
    """One row per compiled binary of every ``@triton.jit`` function in the loaded
    ``splash.kernels_triton`` modules."""
    props = torch.cuda.get_device_properties(dev)
    regs_sm = getattr(props, "regs_per_multiprocessor", 65536)
    smem_sm = getattr(props, "shared_memory_per_multiprocessor", 233472)
    reserve = 1024 if torch.version.hip is None else 0
    rows = []
    for name, mod in sorted(sys.modules.items()):
        if not name.startswith("splash.kernels_triton.") or mod is None:
            continue
        for attr, fn in inspect.getmembers(mod, lambda x: isinstance(x, triton.JITFunction)):
            if fn.__module__ != name:
                continue  # imported from another module: listed there
            for kernel in _compiled(fn):
                try:
                    kernel._init_handles()
                except Exception:  # noqa: BLE001  (a binary for another device)
                    continue
                meta = kernel.metadata
                warps, shared = int(meta.num_warps), int(meta.shared)
                regs = int(kernel.n_regs)
                by_regs = regs_sm // max(-(-regs // 8) * 8 * 32 * warps, 1)  # 8-register steps
                # the driver reserves 1 KB of an NVIDIA SM's shared memory per resident program
                by_smem = smem_sm // (shared + reserve) if shared else 32
                rows.append({"kernel": attr, "num_warps": warps,
                             "num_stages": int(getattr(meta, "num_stages", 0)),
                             "registers": regs, "spills": int(kernel.n_spills),
                             "shared_bytes": shared,
                             "programs_an_sm": max(min(by_regs, by_smem, 64 // warps), 0)})
    return rows
