"""Bad input to the `splash` command line ends in one clear line and exit code 2, never a
traceback; checks that need no model run happen before the model is loaded."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest
import torch
from tiny_models import checkpoint

from splash.cli import main

pytestmark = pytest.mark.timeout(120)
CPU = ["--backend", "cpu"]
MISSING = "/nonexistent/splash-model"


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse
        rc = int(e.code or 0)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return rc, err.strip().splitlines()[-1] if err.strip() else ""


def _copy(path: str) -> str:
    out = tempfile.mkdtemp(prefix="splash-bad-")
    shutil.copytree(path, out, dirs_exist_ok=True)
    return out


def test_broken_config_json(capsys) -> None:
    bad = _copy(checkpoint("v3"))
    with open(os.path.join(bad, "config.json"), "w") as f:
        f.write('{"model_type": "deepseek_v3", ')
    rc, line = _run(["generate", "--model", bad, *CPU], capsys)
    assert rc == 2 and "config.json" in line and "JSON" in line, line


def test_truncated_safetensors_at_tp1(capsys) -> None:
    bad = _copy(checkpoint("v3"))
    weights = os.path.join(bad, "model.safetensors")
    os.truncate(weights, os.path.getsize(weights) // 2)
    rc, line = _run(["generate", "--model", bad, *CPU, "--max-tokens", "1"], capsys)
    assert rc == 2 and "model.safetensors" in line, line


@pytest.mark.parametrize("flags, words", [
    (["--dtype", "fp64"], ["fp64", "fp32"]),
    (["--kv-dtype", "int4"], ["int4"]),
    (["--dtype", "bf16"], ["bf16", "cpu"]),  # the Triton interpreter computes bf16 wrongly
    (["--kv-dtype", "bf16"], ["bf16", "fp32"]),  # KV must match the fp32 activations
    (["--kv-dtype", "fp16"], ["fp16"]),
    (["--kv-dtype", "fp8"], ["fp8", "cpu"]),
])
def test_unsupported_dtypes_refused_at_start(capsys, flags, words) -> None:
    rc, line = _run(["generate", "--model", checkpoint("v3"), *CPU, *flags], capsys)
    assert rc == 2 and all(w in line for w in words), line


def test_serve_refuses_unsupported_kv_dtype_before_serving(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-m", "splash.cli", "serve", "--model",
                           checkpoint("v3"), *CPU, "--kv-dtype", "bf16", "--port", "0"],
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 2, proc.stderr
    assert "splash serve: zmq" not in proc.stdout and "Traceback" not in proc.stderr
    assert "kv" in proc.stderr.strip().splitlines()[-1].lower()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_backend_without_gpu(capsys) -> None:
    rc, line = _run(["generate", "--model", checkpoint("v3"), "--backend", "cuda"], capsys)
    assert rc == 2 and "cuda" in line and "available" in line, line


def test_bad_layout_plan_checked_before_the_model(capsys) -> None:
    rc, line = _run(["generate", "--model", MISSING, *CPU, "--layout-plan", "1:foo"], capsys)
    assert rc == 2 and "foo" in line and "dop" in line, line


def test_port_in_use_reported_before_the_model(capsys) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        for flag in ("--port", "--http-port"):
            other = ["--port", "0"] if flag == "--http-port" else []
            rc, line = _run(["serve", "--model", MISSING, *CPU, *other, flag, str(port)],
                            capsys)
            assert rc == 2 and str(port) in line and "in use" in line, line


@pytest.mark.parametrize("port", ["99999", "-1"])
def test_port_out_of_range(capsys, port) -> None:
    rc, line = _run(["serve", "--model", MISSING, "--port", port], capsys)
    assert rc == 2 and "65535" in line, line


def test_simulate_when_nothing_fits(capsys) -> None:
    rc, line = _run(["simulate", "--model", "deepseek-v3", "--hardware", "h200", "--tp", "1",
                     "--requests", "4"], capsys)
    assert rc == 2 and "fit" in line, line


def test_simulate_missing_trace_file(capsys) -> None:
    rc, line = _run(["simulate", "--trace", "/nonexistent/trace.jsonl"], capsys)
    assert rc == 2 and "trace.jsonl" in line, line


@pytest.mark.parametrize("cmd", [["plan", "--model", "deepseek-v3"],
                                 ["plan", "--model", "deepseek-v3", "--json"],
                                 ["simulate", "--requests", "8"]])
def test_output_into_a_closed_pipe(cmd) -> None:
    """`splash plan | head -1`: the reader goes away; no BrokenPipeError traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "splash.cli", *cmd], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    proc.stdout.close()  # before anything is written: every write hits a closed pipe
    err = proc.stderr.read() if proc.stderr else ""
    proc.wait(100)
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert proc.returncode in (0, 1, 141)
