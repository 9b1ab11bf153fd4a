"""`splash calibrate` on the CPU: real gloo processes, small sizes; the result loads as a profile."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from splash.backends.profiles import HardwareProfile, load_profile
from splash.planning.calibrate import calibrate_main


@pytest.mark.slow
def test_calibrate_cpu_tp2_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cal.json"
    args = argparse.Namespace(backend="cpu", tp_size=2, out=str(out), quick=True)
    assert calibrate_main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    stored = json.loads(out.read_text())
    assert printed["written_to"] == str(out) and stored["measured"]["tp"] == 2
    m = stored["measured"]
    assert m["matmul_tflops"] > 0 and m["copy_gbps"] > 0
    assert m["allgather_busbw_gbps"] > 0 and m["allgather_latency_us"] > 0
    assert m["collective_backend"] == "gloo"
    prof = load_profile("cpu", str(out))
    assert isinstance(prof, HardwareProfile) and prof.source == str(out)
    assert prof.link_gbps == pytest.approx(m["allgather_busbw_gbps"])
    assert prof.peak_bf16_tflops == pytest.approx(m["matmul_tflops"])
