"""`splash.model.overlap`: off unless asked for on a CUDA device; when off, `both` runs its
two pieces in order on the current stream (the GPU tier checks the two-stream engine's
tokens in tests/reference/test_cuda_graphs.py)."""

from __future__ import annotations

import torch

from splash.model import overlap


def test_overlap_needs_cuda_and_the_switch(monkeypatch):
    monkeypatch.setenv("SPLASH_OVERLAP", "1")
    assert not overlap.enable(torch.device("cpu"))
    monkeypatch.setenv("SPLASH_OVERLAP", "")
    assert not overlap.enable(torch.device("cpu"))


def test_both_runs_side_then_main_when_off():
    overlap.enable(torch.device("cpu"))
    order: list[str] = []
    a, b = overlap.both(lambda: order.append("side") or 1, lambda: order.append("main") or 2)
    assert (a, b) == (1, 2) and order == ["side", "main"]
