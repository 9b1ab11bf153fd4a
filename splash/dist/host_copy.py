"""Host-to-device copies that do not wait for the device: the host tensor goes through pinned
memory, so a step's inputs can be copied while the step before still runs (torch's caching
host allocator keeps the pinned block until the copy is done)."""

from __future__ import annotations

import torch


def pinned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` in pinned host memory when it is to be copied to a CUDA ``device``."""
    return t.pin_memory() if device.type == "cuda" and t.device.type == "cpu" else t


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (host) on ``device``, copied without waiting for the device."""
    return pinned(t, device).to(device, non_blocking=True)
