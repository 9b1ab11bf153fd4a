"""moe_route against its torch reference (transformers' DeepSeek routing) for every router."""

from __future__ import annotations

import pytest
import torch

from splash.kernels_triton import moe_route, moe_route_ref

ROUTERS = {  # name: (scoring, method, groups, topk_group, k, norm, scale, bias)
    "v3": ("sigmoid", "noaux_tc", 4, 2, 3, True, 2.5, True),
    "v3_8x": ("sigmoid", "noaux_tc", 8, 4, 8, True, 2.5, True),
    "v2_groups": ("softmax", "group_limited_greedy", 4, 2, 3, False, 1.5, False),
    "v2_greedy": ("softmax", "greedy", 1, 1, 6, False, 1.0, False),
    "kimi_one_group": ("sigmoid", "noaux_tc", 1, 1, 2, True, 2.8, True),
}


@pytest.mark.parametrize("name", list(ROUTERS))
@pytest.mark.parametrize("experts", [16, 64])
def test_routing_matches_reference(device, name, experts):
    scoring, method, groups, topk_group, k, norm, scale, has_bias = ROUTERS[name]
    gen = torch.Generator().manual_seed(experts)
    logits = (torch.randn(7, experts, generator=gen) * 2).to(device)
    bias = (torch.randn(experts, generator=gen) * 0.1).to(device) if has_bias else None
    args = (scoring, method, groups, topk_group, k, norm, scale)
    w, ids = moe_route(logits, bias, *args)
    rw, rids = moe_route_ref(logits, bias, *args)
    assert ids.dtype == torch.int64 and w.shape == (7, k)
    assert torch.equal(ids.cpu(), rids.cpu())
    torch.testing.assert_close(w.cpu(), rw.cpu(), atol=1e-6, rtol=1e-5)


def test_bad_arguments_raise_clear_errors(device):
    logits = torch.randn(2, 12, device=device)
    with pytest.raises(ValueError, match="groups"):
        moe_route(logits, None, "sigmoid", "noaux_tc", 5, 2, 2, True, 1.0)
    with pytest.raises(ValueError, match="method"):
        moe_route(logits, None, "sigmoid", "top", 1, 1, 2, True, 1.0)
    with pytest.raises(ValueError, match="k = 13"):
        moe_route(logits, None, "softmax", "greedy", 1, 1, 13, False, 1.0)
    with pytest.raises(ValueError, match="bias"):
        moe_route(logits, torch.zeros(11, device=device), "sigmoid", "noaux_tc", 1, 1, 2,
                  True, 1.0)
