"""The GPU fast paths off their hardware: `splash.model.overlap` (on only on a CUDA device, and
there unless SPLASH_OVERLAP=0; when off, `both` runs its two pieces in order on the current stream) and
`Comm.sum_partials` (NCCL / gloo unless the symmetric-memory all-reduce is on). The GPU tier
checks the two-stream engine's tokens in tests/reference/test_cuda_graphs.py."""

from __future__ import annotations

import torch

from splash.model import overlap


def test_overlap_needs_cuda_and_the_switch(monkeypatch):
    for value in ("", "1", "0"):
        monkeypatch.setenv("SPLASH_OVERLAP", value)
        assert not overlap.enable(torch.device("cpu"))


def test_both_runs_side_then_main_when_off():
    overlap.enable(torch.device("cpu"))
    order: list[str] = []
    a, b = overlap.both(lambda: order.append("side") or 1, lambda: order.append("main") or 2)
    assert (a, b) == (1, 2) and order == ["side", "main"]
    pending = overlap.start(lambda: order.append("started") or 3)
    assert order[-1] == "started" and pending.result() == 3 and pending.result() == 3


def test_partials_are_summed_by_nccl_or_gloo_unless_the_fast_path_is_on(monkeypatch):
    """`Comm.sum_partials`: the one-shot all-reduce on symmetric memory is an NVIDIA-only
    opt-in (SPLASH_FAST_ALLREDUCE=1); elsewhere, and at T=1, the sum is the group's
    all-reduce (the identity at T=1)."""
    from splash.dist.comm import Comm

    monkeypatch.setenv("SPLASH_FAST_ALLREDUCE", "1")
    one = Comm(0, 1)
    t = torch.arange(6.0)
    assert not one.enable_fast_sum(torch.device("cpu"), torch.float32)
    assert one.sum_partials(t) is t
    two = Comm(0, 2, use_dist=False)  # no group: never set up
    assert not two.enable_fast_sum(torch.device("cpu"), torch.float32)
