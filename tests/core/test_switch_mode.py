"""How ``switch_mode="auto"`` picks a mechanism per switch: blocking when the predicted
transfer is shorter than a pre-copy's extra planning round (nothing moving included), live
when the running step covers the transfer twice over, else a background pre-copy. Controller
only: no workers."""

from __future__ import annotations

import dataclasses

import pytest
from tiny_models import checkpoint

from splash.core.ownership import LAYOUTS
from splash.core.request import Request
from splash.engine.config import EngineConfig
from splash.engine.setup import build_scheduler, resolve_setup
from splash.engine.switches import SwitchController
from splash.sampling_params import SamplingParams
from splash.switching.manifest import build_manifest


def _controller(link_gbps: float):
    setup = resolve_setup(EngineConfig(model=checkpoint(), tp_size=2, backend="cpu",
                                       layout="dp", kv_pages_per_rank=512))
    setup = dataclasses.replace(setup, profile=dataclasses.replace(setup.profile,
                                                                   link_gbps=link_gbps))
    sched = build_scheduler(setup)
    for i in range(4):
        sched.add(Request(f"r{i}", list(range(3 + 50 * i, 3 + 50 * i + 40)),
                          SamplingParams(max_tokens=4)))
    for req, n in sched.schedule().entries:
        req.num_computed += n
    return SwitchController(sched, setup), sched, setup


def _manifest(sched, setup, dst: str):
    return build_manifest(sched.layout, LAYOUTS[dst], sched.running, sched.alloc, setup.world,
                          setup.page_size, setup.model_cfg.num_attention_heads)


@pytest.mark.parametrize("dst", ["dop", "tp"])
def test_auto_mode_follows_the_predicted_transfer(dst):
    # dp -> dop moves nothing (KV stays with owners, heads discarded); dp -> tp all-gathers KV
    fast, sched, setup = _controller(link_gbps=1e9)  # any transfer is instant
    m = _manifest(sched, setup, dst)
    assert fast._mode(m, step_ms_ema=0.0) == "blocking"
    slow, sched, setup = _controller(link_gbps=1e-6)  # a kilobyte takes seconds
    m = _manifest(sched, setup, dst)
    moves = sum(s.kv_rows_received for s in m.summary) + sum(
        len(h) for w in m.weights for h in w.recv_from)
    if moves == 0:
        assert slow._mode(m, step_ms_ema=0.0) == "blocking"
    else:
        assert slow._mode(m, step_ms_ema=0.0) == "background"
        assert slow._mode(m, step_ms_ema=1e12) == "live"
