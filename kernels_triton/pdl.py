"""Programmatic dependent launch (Hopper and newer): a kernel launched with ``launch_pdl``
may have its programs resident, and past their launch, while the kernel before it in the
stream still runs; they wait for it in ``pdl_enter`` before they read or write anything, so
the boundary costs no launch ramp. A kernel not so launched (torch's, or any launch on another
GPU) waits for the one before as usual, and a PDL kernel after it finds nothing to wait for."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splash import envs
from splash.kernels_triton._validate import _capability, interpreting


def pdl(device: torch.device) -> bool:
    """Whether launches on ``device`` take PDL: an NVIDIA GPU of compute capability 9.0 or
    newer, compiled, unless ``SPLASH_PDL=0``."""
    return (device.type == "cuda" and torch.version.hip is None and not interpreting()
            and envs.get("SPLASH_PDL") != "0" and _capability(device.index) >= (9, 0))


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """A PDL kernel's first step: wait until the kernel before it has finished (its writes
    visible), then let the next kernel's programs launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
