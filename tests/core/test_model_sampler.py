"""Sampler: greedy, temperature / top-k / top-p restriction, per-request seeded reproducibility."""

from __future__ import annotations

import torch

from splash.model.sampler import mix_seed, sample

torch.set_num_threads(1)  # tiny tensors: extra threads only contend under xdist


def _params(n, temperature=1.0, top_p=1.0, top_k=0):
    return (torch.full((n,), float(temperature)), torch.full((n,), float(top_p)),
            torch.full((n,), top_k, dtype=torch.int64))


def test_greedy_is_argmax_first_index_on_ties():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 0.0, 0.0]])
    assert sample(logits, *_params(2, temperature=0.0)).tolist() == [1, 0]


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(0))
    want = logits.argmax(-1)
    assert torch.equal(sample(logits, *_params(16, 1.5, top_k=1)), want)
    assert torch.equal(sample(logits, *_params(16, 1.5, top_p=1e-6)), want)


def test_top_k_and_top_p_restrict_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(400, 1)
    g = torch.Generator().manual_seed(1)
    assert set(sample(logits, *_params(400, top_k=2), generator=g).tolist()) == {0, 1}
    # top_p 0.7: tokens 0 (0.5) and 1 (reaches 0.8) kept, 2 and 3 dropped
    assert set(sample(logits, *_params(400, top_p=0.7), generator=g).tolist()) == {0, 1}
    counts = torch.bincount(sample(logits, *_params(400), generator=g), minlength=4)
    assert counts[0] > counts[1] > counts[2] and counts[3] < 60


def test_seeded_rows_reproduce_regardless_of_batch():
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(2))
    seeds, steps = [11, None, 11], [4, 0, 5]
    a = sample(logits, *_params(3, 0.9), seeds=seeds, steps=steps)
    b = sample(logits[[2, 0]], *_params(2, 0.9), seeds=[11, 11], steps=[5, 4])
    assert a[0] == b[1] and a[2] == b[0]
    draws = {int(sample(logits[:1], *_params(1, 5.0), seeds=[11], steps=[s])) for s in range(30)}
    assert len(draws) > 5  # the step changes the draw
    assert mix_seed(1, 2) != mix_seed(2, 1) and 0 <= mix_seed(2**70, 3) < 2**63


def test_mixed_greedy_and_random_rows():
    logits = torch.randn(4, 30)
    t = torch.tensor([0.0, 1.0, 0.0, 1.0])
    out = sample(logits, t, torch.ones(4), torch.zeros(4, dtype=torch.int64))
    assert out.dtype == torch.int64 and out[0] == logits[0].argmax() and out[2] == logits[2].argmax()
