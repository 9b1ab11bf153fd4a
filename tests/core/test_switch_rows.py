"""A switch's row slots: the controller's runs of consecutive pool slots, expanded on the
device into one slot per row (peers in order), against a plain expansion."""

from __future__ import annotations

import random

import torch

from splash.switching.executor import slots_from_runs


def test_runs_expand_to_every_row_in_peer_order():
    rng = random.Random(0)
    for world in (1, 2, 4, 8):
        runs = [[x for _ in range(rng.randint(0, 5)) for x in (rng.randint(0, 999),
                                                             rng.randint(1, 70))]
                for _ in range(world)]
        want = [s + i for peer in runs for s, n in zip(peer[::2], peer[1::2]) for i in range(n)]
        assert slots_from_runs(runs, torch.device("cpu")).tolist() == want


def test_no_rows_is_an_empty_index():
    got = slots_from_runs([[], []], torch.device("cpu"))
    assert got.numel() == 0 and got.dtype == torch.long
