"""Synthetic traces: determinism, shapes of the distributions, the jsonl loader's errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from splash.planning import workloads as W


def test_generators_are_seeded() -> None:
    for gen in (W.rollout, W.agentic, W.chat, W.stationary):
        assert gen(seed=3) == gen(seed=3)
    assert W.rollout(seed=1) != W.rollout(seed=2)


def test_rollout_is_heavy_tailed_and_starts_together() -> None:
    tr = W.rollout(n=256, seed=0)
    assert len(tr) == 256 and all(r.arrival_s == 0.0 for r in tr)
    out = np.array([r.output_len for r in tr])
    assert out.max() > 8 * np.median(out)  # a few very long generations
    assert (out < np.median(out) * 2).mean() > 0.6  # many short ones


def test_agentic_chat_stationary_shapes() -> None:
    ag = W.agentic(sessions=4, turns=3, prefix_len=8192)
    assert len(ag) == 12 and {r.prefix_group for r in ag} == {0, 1, 2, 3}
    assert all(r.prompt_len > 4096 for r in ag)
    by_session = [[r.prompt_len for r in ag if r.prefix_group == s] for s in range(4)]
    assert all(sorted(p) == p for p in by_session)  # context grows turn by turn
    ch = W.chat(n=100, rate_per_s=10)
    arrivals = [r.arrival_s for r in ch]
    assert arrivals == sorted(arrivals) and 4 < arrivals[-1] < 20
    st = W.stationary(n=8, prompt_len=100, output_len=10)
    assert {(r.prompt_len, r.output_len) for r in st} == {(100, 10)}


def test_grpo_groups_share_a_template() -> None:
    tr = W.grpo(prompts=64, n=8, seed=1)
    assert W.grpo(prompts=64, n=8, seed=1) == tr and len(tr) == 64
    assert {r.n for r in tr} == {8} and {r.prefix_group for r in tr} == set(range(64))
    assert all(r.prompt_len > r.common_prefix_len == 512 and r.arrival_s == 0 for r in tr)
    assert np.median([r.output_len for r in tr]) > 1000  # long generations
    assert W.summary(tr)["samples"] == 512
    small = W.scaled(tr, max_prompt=128, max_output=32)
    assert all(0 < r.common_prefix_len < r.prompt_len <= 128 for r in small)
    assert W.get_trace("grpo", n=4)[0].n == 8 and len(W.get_trace("grpo", n=4)) == 4


def test_scaled_bounds_lengths() -> None:
    tr = W.scaled(W.rollout(n=64), max_prompt=128, max_output=32)
    assert max(r.prompt_len for r in tr) <= 128 and max(r.output_len for r in tr) <= 32
    assert min(r.output_len for r in tr) >= 1


def test_load_jsonl_roundtrip_and_errors(tmp_path: Path) -> None:
    good = tmp_path / "t.jsonl"
    good.write_text('{"prompt_len": 5, "output_len": 3, "arrival_s": 1.5}\n\n# comment\n'
                    '{"prompt_len": 7, "output_len": 2}\n')
    tr = W.load_jsonl(good)
    assert [(r.prompt_len, r.arrival_s) for r in tr] == [(7, 0.0), (5, 1.5)]
    cases = {
        "not json": "not JSON",
        '{"prompt_len": 5}': "missing output_len",
        '{"prompt_len": 5.5, "output_len": 3}': "must be integers",
        '{"prompt_len": 0, "output_len": 3}': ">= 1",
        '{"prompt_len": 5, "output_len": 3, "arrival_s": -1}': "arrival_s",
        "[1, 2]": "expected an object",
    }
    for line, message in cases.items():
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"prompt_len": 1, "output_len": 1}\n' + line + "\n")
        with pytest.raises(W.TraceError, match=f"bad.jsonl:2: .*{message}"):
            W.load_jsonl(bad)
    with pytest.raises(W.TraceError, match="does not exist"):
        W.load_jsonl(tmp_path / "missing.jsonl")


def test_get_trace_and_main(capsys: pytest.CaptureFixture[str]) -> None:
    assert len(W.get_trace("chat", n=10)) == 10
    with pytest.raises(W.TraceError):
        W.get_trace("nope")
    assert W.main(["rollout", "--n", "16"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["requests"] == 16 and summary["output"]["max"] >= summary["output"]["p50"]


def test_rollout_groups_samples_per_prompt() -> None:
    tr = W.rollout(n=64, group=8, seed=2, output_median=192, max_output=1024)
    assert len(tr) == 64 and W.rollout(n=64, group=8, seed=2, output_median=192,
                                       max_output=1024) == tr
    groups = {g: [r for r in tr if r.prefix_group == g] for g in range(8)}
    assert all(len(v) == 8 for v in groups.values())
    assert all(len({r.prompt_len for r in v}) == 1 for v in groups.values())  # one prompt
    assert len({r.output_len for r in groups[0]}) > 1  # samples end at different lengths
    out = np.array([r.output_len for r in tr])
    assert out.max() <= 1024 and out.max() > 3 * np.median(out)  # few long, many short
    assert all(r.prefix_group is None for r in W.rollout(n=4, group=1))


def test_bursty_arrives_in_bursts() -> None:
    tr = W.bursty(n=96, bursts=4, gap_s=3.0, burst_span_s=0.5, seed=1)
    assert tr == W.bursty(n=96, bursts=4, gap_s=3.0, burst_span_s=0.5, seed=1)
    arrivals = np.array([r.arrival_s for r in tr])
    assert (np.diff(arrivals) >= 0).all()
    bursts = np.floor(arrivals / 3.0)
    assert set(bursts) == {0, 1, 2, 3}
    assert np.allclose(arrivals - 3.0 * bursts, np.clip(arrivals - 3.0 * bursts, 0, 0.5))
    with pytest.raises(W.TraceError):
        W.bursty(bursts=0)


def test_get_trace_passes_parameters() -> None:
    tr = W.get_trace("rollout", seed=0, n=16, group=4, max_output=64)
    assert len(tr) == 16 and max(r.output_len for r in tr) <= 64
    assert len({r.prefix_group for r in tr}) == 4
    assert len(W.get_trace("bursty", n=10, bursts=2)) == 10
    with pytest.raises(W.TraceError, match="stationary"):
        W.get_trace("stationary", no_such_argument=1)
