"""MLAAttention head placement and a world=2 tensor-parallel MLAModel (threads as ranks)."""

from __future__ import annotations

import threading

import pytest
import torch

from splash.errors import ConfigError
from splash.model.attention import MLAAttention
from splash.model.loader import from_pretrained_dir
from splash.model.model import DenseReferenceAttention, MLAModel
from splash.model.presets import make_model

torch.set_num_threads(1)  # tiny tensors: extra threads only contend under xdist


@pytest.fixture(scope="module", params=["deepseek-v3", "deepseek-v2-lite"])
def tiny(request, tmp_path_factory):
    return from_pretrained_dir(make_model(tmp_path_factory.mktemp("m"), request.param, seed=2))


@torch.no_grad()
def test_head_ranges_partition_the_full_attention(tiny):
    cfg, weights = tiny
    H, L = cfg.num_attention_heads, cfg.kv_lora_rank
    full = MLAAttention.from_weights(cfg, weights, 1)
    halves = [MLAAttention.from_weights(cfg, weights, 1, s, H // 2) for s in (0, H // 2)]
    x, pos = torch.randn(6, cfg.hidden_size), torch.tensor([0, 1, 2, 7, 8, 100])
    q = full.query(x, pos)
    assert q.shape == (6, H, cfg.kv_dim) and full.latent(x, pos).shape == (6, cfg.kv_dim)
    torch.testing.assert_close(torch.cat([h.query(x, pos) for h in halves], 1), q)
    torch.testing.assert_close(halves[1].latent(x, pos), full.latent(x, pos))
    o = torch.randn(6, H, L)
    parts = [h.output(o[:, h.head_start:h.head_start + h.num_heads]) for h in halves]
    torch.testing.assert_close(parts[0] + parts[1], full.output(o), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_set_placed_swaps_head_range(tiny):
    cfg, weights = tiny
    H = cfg.num_attention_heads
    a = MLAAttention.from_weights(cfg, weights, 0, 0, H // 2)
    b = MLAAttention.from_weights(cfg, weights, 0, H // 2, H - H // 2)
    x, pos = torch.randn(3, cfg.hidden_size), torch.arange(3)
    want = b.query(x, pos)
    a.set_placed(b.head_start, b.placed_weights())
    assert (a.head_start, a.num_heads) == (H // 2, H - H // 2)
    torch.testing.assert_close(a.query(x, pos), want)
    bad = dict(b.placed_weights(), w_o=b.w_o[:, :-1])
    with pytest.raises(ConfigError, match="w_o"):
        a.set_placed(0, bad)
    with pytest.raises(ConfigError, match="head range"):
        a.set_placed(H - 1, b.placed_weights())


@torch.no_grad()
def test_returning_to_a_head_range_reuses_its_memory(tiny):
    """CUDA graphs captured in a layout read the placed weights' addresses: a switch away and
    back must land in the same tensors (with the values the switch delivered)."""
    cfg, weights = tiny
    H = cfg.num_attention_heads
    a = MLAAttention.from_weights(cfg, weights, 0, 0, H // 2)
    a.keep_placements = True  # what a worker replaying CUDA graphs sets
    full = MLAAttention.from_weights(cfg, weights, 0, 0, H)
    first = {k: t.data_ptr() for k, t in a.placed_weights().items()}
    x, pos = torch.randn(3, cfg.hidden_size), torch.arange(3)
    want = a.query(x, pos)
    a.set_placed(0, full.placed_weights())  # e.g. TP -> DP: all heads
    assert a.num_heads == H
    back = {k: t.clone() for k, t in a.placed_weights().items()}  # DP -> TP: fresh tensors
    a.set_placed(0, {k: t[: H // 2].clone() for k, t in back.items()})
    assert {k: t.data_ptr() for k, t in a.placed_weights().items()} == first
    torch.testing.assert_close(a.query(x, pos), want)


@torch.no_grad()
def test_without_graphs_a_switch_frees_the_previous_placement(tiny):
    cfg, weights = tiny
    H = cfg.num_attention_heads
    a = MLAAttention.from_weights(cfg, weights, 0, 0, H // 2)
    full = MLAAttention.from_weights(cfg, weights, 0, 0, H)
    a.set_placed(0, full.placed_weights())
    assert list(a._buffers) == [(0, H)]  # the H/2-head tensors are no longer held


class _ThreadGroup:
    """all_reduce among `world` threads: every rank gets the sum of all ranks' tensors."""

    def __init__(self, world: int) -> None:
        self.barrier, self.slots = threading.Barrier(world), [None] * world

    def all_reduce(self, rank: int, t: torch.Tensor) -> torch.Tensor:
        self.slots[rank] = t
        self.barrier.wait()
        total = sum(self.slots)
        self.barrier.wait()
        return total


@torch.no_grad()
def test_tp2_model_equals_world1(tiny):
    cfg, weights = tiny
    ids = torch.randint(0, cfg.vocab_size, (10,), generator=torch.Generator().manual_seed(4))
    pos = torch.cat([torch.arange(6), torch.arange(4)])
    seqs = [0] * 6 + [1] * 4
    ref = DenseReferenceAttention()
    ref.set_step(seqs, pos)
    base = MLAModel(cfg, weights)
    want = base.compute_logits(base(ids, pos, ref))

    world, h = 2, cfg.num_attention_heads // 2
    group, got = _ThreadGroup(world), [None] * world
    models = [MLAModel(cfg, weights, r, world, r * h, h) for r in range(world)]

    def run(rank: int) -> None:
        ref_r = DenseReferenceAttention()
        ref_r.set_step(seqs, pos)

        def reduce(t: torch.Tensor) -> torch.Tensor:
            return group.all_reduce(rank, t)

        def attn_fn(i: int, attn: MLAAttention, x: torch.Tensor) -> torch.Tensor:
            return reduce(ref_r(i, attn, x))  # TP: partial over held heads, then all-reduce

        m = models[rank]
        got[rank] = m.compute_logits(m(ids, pos, attn_fn, reduce))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for g in got:
        torch.testing.assert_close(g, want, atol=1e-4, rtol=0)


def test_reference_attention_rejects_gaps(tiny):
    cfg, weights = tiny
    model, ref = MLAModel(cfg, weights), DenseReferenceAttention()
    ref.set_step([0, 0], torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="do not continue"):
        model(torch.tensor([3, 4]), torch.tensor([1, 2]), ref)
