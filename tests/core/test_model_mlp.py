"""Tensor-parallel MLP / MoE: partials of all ranks sum to the world=1 output; routing rules."""

from __future__ import annotations

import pytest
import torch

from splash.model.config import ModelConfig
from splash.model.loader import from_pretrained_dir
from splash.model.mlp import DenseMLP, MoE, select_experts, shard_range
from splash.model.presets import checkpoint_shapes, make_model, preset_config

torch.set_num_threads(1)  # tiny tensors: extra threads only contend under xdist


@pytest.fixture(scope="module", params=["deepseek-v3", "deepseek-v2-lite", "kimi-k2"])
def tiny(request, tmp_path_factory):
    return from_pretrained_dir(make_model(tmp_path_factory.mktemp("m"), request.param, seed=5))


def test_shard_range_covers_evenly():
    for n, world in [(32, 2), (10, 3), (2, 4)]:
        ranges = [shard_range(n, r, world) for r in range(world)]
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert max(e - s for s, e in ranges) - min(e - s for s, e in ranges) <= 1


@pytest.mark.parametrize("world", [2, 3])
@torch.no_grad()
def test_moe_partials_sum_to_full(tiny, world):
    cfg, weights = tiny
    layer = next(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    prefix = f"model.layers.{layer}.mlp."
    x = torch.randn(9, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    full = MoE.from_weights(cfg, weights, prefix)(x)
    parts = [MoE.from_weights(cfg, weights, prefix, r, world)(x) for r in range(world)]
    torch.testing.assert_close(sum(parts), full, atol=1e-5, rtol=1e-5)
    assert full.abs().max() > 0.1


@pytest.mark.parametrize("world", [2, 3])
@torch.no_grad()
def test_dense_partials_sum_to_full(tiny, world):
    cfg, weights = tiny
    x = torch.randn(5, cfg.hidden_size)
    p = "model.layers.0.mlp."
    full = DenseMLP.from_weights(weights, p, cfg.intermediate_size)(x)
    parts = [DenseMLP.from_weights(weights, p, cfg.intermediate_size, r, world)(x)
             for r in range(world)]
    torch.testing.assert_close(sum(parts), full, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_moe_matches_naive_per_token_loop(tiny):
    cfg, weights = tiny
    layer = next(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    p = f"model.layers.{layer}.mlp."
    moe = MoE.from_weights(cfg, weights, p)
    x = torch.randn(4, cfg.hidden_size)
    w, ids = moe.route(x)

    def mlp(q: str, v: torch.Tensor) -> torch.Tensor:
        g, u, d = (weights[f"{q}{n}_proj.weight"] for n in ("gate", "up", "down"))
        return (torch.nn.functional.silu(v @ g.t()) * (v @ u.t())) @ d.t()

    for n in range(4):
        want = sum(w[n, j] * mlp(f"{p}experts.{int(ids[n, j])}.", x[n]) for j in range(ids.shape[1]))
        if cfg.n_shared_experts:
            want = want + mlp(p + "shared_experts.", x[n])
        torch.testing.assert_close(moe(x)[n], want, atol=1e-5, rtol=1e-5)


def _cfg(**over) -> ModelConfig:
    d = preset_config("deepseek-v3", "tiny")
    d.update(over)
    return ModelConfig.from_hf(d)


def test_noaux_tc_group_limit_and_bias():
    cfg = _cfg(n_routed_experts=8, n_group=4, topk_group=1, num_experts_per_tok=2,
               norm_topk_prob=False, routed_scaling_factor=2.0)
    logits = torch.tensor([[5.0, -5, -5, -5, 4, 4, -5, -5]])
    # group scores (top-2 sums): g0 = s(5)+s(-5), g2 = s(4)+s(4) wins -> experts 4, 5
    w, ids = select_experts(logits, cfg, torch.zeros(8))
    assert sorted(ids[0].tolist()) == [4, 5]
    torch.testing.assert_close(w[0], 2.0 * torch.sigmoid(torch.tensor([4.0, 4.0])))
    # the correction bias steers the choice but not the weights
    bias = torch.tensor([0, 0, 0, 0, 0, 0, 3.0, 3.0])
    w, ids = select_experts(logits, cfg, bias)
    assert sorted(ids[0].tolist()) == [6, 7]
    torch.testing.assert_close(w[0], 2.0 * torch.sigmoid(torch.tensor([-5.0, -5.0])))


def test_v2_softmax_greedy_and_group_limited():
    base = preset_config("deepseek-v2-lite", "tiny")
    greedy = ModelConfig.from_hf({**base, "num_experts_per_tok": 2, "routed_scaling_factor": 1.0})
    logits = torch.tensor([[3.0, 0, 0, 2.9, 0, 0, 0, 0]])
    w, ids = select_experts(logits, greedy, None)
    assert sorted(ids[0].tolist()) == [0, 3]
    assert torch.allclose(w.sort().values, logits.softmax(-1)[0, [3, 0]][None])
    grouped = ModelConfig.from_hf({**base, "num_experts_per_tok": 2, "n_group": 4,
                                   "topk_group": 1, "topk_method": "group_limited_greedy"})
    w, ids = select_experts(logits, grouped, None)  # group 0 (experts 0, 1) has the max
    assert sorted(ids[0].tolist()) == [0, 1]


def test_checkpoint_shapes_match_written_tiny(tiny):
    cfg, weights = tiny
    shapes = checkpoint_shapes(cfg)
    assert set(shapes) == set(weights)
    assert all(tuple(weights[k].shape) == shapes[k] for k in weights)
