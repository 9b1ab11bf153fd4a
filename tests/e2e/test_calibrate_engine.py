"""`splash calibrate --model` on the CPU (tiny model, two gloo ranks): the fit improves on the
roofline over the measured points, and the profile it writes is the one `auto` then uses. The
engine's start-up warm-up leaves nothing behind: counters, switch history and prefix cache are
as at start, and generation gives transformers' greedy tokens, as an engine that did not warm
up does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_models import DEV, checkpoint, hf_greedy, mixed_prompts

from splash import LLM, SamplingParams
from splash.cli.main import main
from splash.engine.auto_layout import AutoLayout
from splash.engine.config import EngineConfig
from splash.engine.setup import build_scheduler, resolve_setup

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _model() -> str:
    """Tiny DeepSeek-V3 of one layer, a MoE one (attention, router, experts): the calibration
    sweep and the warm-up run the same steps and switches as over two layers, in two thirds of
    the interpreter's time."""
    return checkpoint("v3", num_hidden_layers=1, first_k_dense_replace=0)


def test_calibrate_quick_fits_and_auto_loads_it(tmp_path: Path, capsys,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "cal.json"
    path = _model()
    assert main(["calibrate", "--backend", "cpu", "--tp", "2", "--model", path, "--quick",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "fitted" in printed and "relative error" in printed
    prof = json.loads(out.read_text())
    fit = prof["fit"]
    layouts = {r["layout"] for r in fit["steps"]}
    assert layouts == {"tp", "dp", "cp", "dop"}
    assert {r["kind"] for r in fit["steps"]} == {"decode", "prefill"}
    assert fit["switches"] and all(r["measured_ms"] > 0 for r in fit["switches"])
    s = fit["summary"]
    assert s["fitted"]["step"]["rms"] <= s["roofline"]["step"]["rms"]  # by construction
    assert s["fitted"]["step"]["rms"] <= s["spec"]["step"]["rms"]
    assert s["fitted"]["switch"]["rms"] <= s["roofline"]["switch"]["rms"]
    assert (tmp_path / "cal.txt").read_text().startswith("step times")
    # auto loads it: the engine's profile and its policy's cost model are the fitted one
    monkeypatch.setenv("SPLASH_CALIBRATION", str(out))
    setup = resolve_setup(EngineConfig(model=path, tp_size=2, backend="cpu", layout="auto"))
    auto = AutoLayout(setup, build_scheduler(setup), margin=0.1)
    used = auto.policy.cost_model.profile
    assert used.source == str(out)
    for name in ("gemm_time_scale", "attention_time_scale", "step_overhead_us",
                 "request_overhead_us",
                 "collective_latency_us", "switch_time_scale"):
        assert getattr(used, name) == pytest.approx(prof[name])


def test_warm_up_leaves_no_trace() -> None:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = mixed_prompts(seed=3, lengths=(5, 9, 17))
    kw = dict(tp_size=2, page_size=4, max_num_batched_tokens=16, **DEV)
    # what an engine that did not warm up gives: transformers' greedy tokens
    ref = hf_greedy(_model(), prompts, params.max_tokens)
    with LLM(_model(), layout="auto", warmup=True, **kw) as llm:
        st = llm.stats()
        assert st["num_steps"] == 0 and st["tokens_generated"] == 0
        assert st["switches"] == [] and st["policy_decisions"] == []
        assert sum(st["prefix_cache_pages"]) == 0 and sum(st["kv_pages_used"]) == 0
        assert st["layout"] == "tp"
        llm.switch_layout("tp")  # hold tp: token identity needs one layout
        got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == ref


def test_warm_up_without_chunked_prefill() -> None:
    """Without chunked prefill a prompt must fit one step's token budget: the warm-up's long
    prompts take the whole budget instead of two chunks (they were refused, and the engine
    did not start), and generation after it gives transformers' greedy tokens."""
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    prompts = mixed_prompts(seed=4, lengths=(5, 12))
    ref = hf_greedy(_model(), prompts, params.max_tokens)
    with LLM(_model(), layout="tp", warmup=True, enable_chunked_prefill=False, page_size=4,
             max_num_batched_tokens=12, **DEV) as llm:
        assert llm.stats()["num_steps"] == 0
        got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == ref
