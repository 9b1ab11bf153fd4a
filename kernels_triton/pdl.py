"""Programmatic dependent launch (Hopper and newer). A kernel launched with ``launch_pdl``
starts with ``pdl_enter``, which waits until the kernel before it in the stream has finished
and its writes are visible: its programs are dispatched as soon as every program of that
kernel has exited, instead of after the kernel's completion reaches the stream, and touch no
memory before the wait (the Gluon decode kernels wait in ``_plan_item``, their first step). Only
the few-head Gluon decode kernels let their dependent (the merge) launch early, once their loop
is done (``_pdl_trigger``): triggered at a kernel's start, the next kernel's programs took SM
slots while the indexer still ran and the DSA layer at 32K slowed 3% at 128 heads
(``benchmarks/results/h200/dsa_pdl.json``); after the loop the 128-head kernels slowed 2-3%
(``decode_pdl_scales.json``); released after top-k's last search or after the few-head
sparse MLA loop, the DSA layer moved within 1% either way (``dsa_pdl_release_tried.json``).
A kernel not so launched (torch's) waits as usual, and a PDL kernel after it finds nothing to
wait for."""

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
    visible)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
