"""ci/run_suite.py picks the right pytest runs for each CI leg (checked with --dry-run)."""

from __future__ import annotations

import importlib.util
import shlex
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "ci" / "run_suite.py"
_spec = importlib.util.spec_from_file_location("run_suite", _PATH)
assert _spec is not None and _spec.loader is not None
run_suite = importlib.util.module_from_spec(_spec)
sys.modules["run_suite"] = run_suite  # dataclasses look the module up by name
_spec.loader.exec_module(run_suite)


def _dry_run(capsys: pytest.CaptureFixture[str], *args: str) -> list[list[str]]:
    """Run main() with --dry-run; return each printed command split into words."""
    assert run_suite.main(["--dry-run", *args]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert all(line.startswith("+ ") for line in lines)
    return [shlex.split(line[2:]) for line in lines]


def _pytest_tail(words: list[str]) -> list[str]:
    """The pytest arguments after '<python> -m pytest'."""
    i = words.index("pytest")
    assert words[i - 2 : i] == [sys.executable, "-m"]
    return words[i + 1 :]


def test_cpu_runs_not_gpu_interpreted_with_xdist(capsys: pytest.CaptureFixture[str]) -> None:
    (cmd,) = _dry_run(capsys, "--backend", "cpu")
    assert cmd[0] == "TRITON_INTERPRET=1"
    assert _pytest_tail(cmd) == ["-q", "-n", "auto", "-m", "not gpu", "tests"]


def test_cpu_jobs_and_extra_args_pass_through(capsys: pytest.CaptureFixture[str]) -> None:
    (cmd,) = _dry_run(capsys, "--backend", "cpu", "--jobs", "4", "--", "-x")
    assert _pytest_tail(cmd) == ["-q", "-n", "4", "-m", "not gpu", "-x", "tests"]


def test_cuda_runs_gpu_then_cpu_safe_suite(capsys: pytest.CaptureFixture[str]) -> None:
    gpu, cpu = _dry_run(capsys, "--backend", "cuda")
    assert gpu[:3] == ["env", "-u", "TRITON_INTERPRET"]  # kernels compiled for the device
    assert _pytest_tail(gpu) == ["-q", "-m", "gpu", "tests"]
    assert cpu[0] == "TRITON_INTERPRET=1"
    assert _pytest_tail(cpu) == ["-q", "-n", "auto", "-m", "not gpu", "tests"]


@pytest.mark.parametrize(
    ("arch", "no_fp8_env", "deselect_fp8"),
    [
        ("gfx942", "", False),
        ("gfx936", "", True),
        ("gfx936:sramecc+", "", True),
        ("gfx942", "1", True),
        ("", "0", False),
    ],
)
def test_rocm_deselects_fp8_on_dcu(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    arch: str,
    no_fp8_env: str,
    deselect_fp8: bool,
) -> None:
    monkeypatch.setenv("SPLASH_NO_FP8", no_fp8_env)
    (cmd,) = _dry_run(capsys, "--backend", "rocm", "--arch", arch)
    expected = ["-q", "-m", "gpu"] + (["-k", "not fp8"] if deselect_fp8 else []) + ["tests"]
    assert _pytest_tail(cmd) == expected
    assert cmd[:3] == ["env", "-u", "TRITON_INTERPRET"]


def test_rocm_detects_arch_when_not_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run_suite, "detect_gfx_arch", lambda: "gfx936")
    (step,) = run_suite.build_steps("rocm", env={})
    assert step.argv[-3:] == ["-k", "not fp8", "tests"]


def test_step_env_sets_and_unsets() -> None:
    cpu, gpu = (run_suite.build_steps("cuda", env={})[i] for i in (1, 0))
    base = {"TRITON_INTERPRET": "1", "PATH": "/bin"}
    assert gpu.env(base) == {"PATH": "/bin", "SPLASH_TEST_GPU": "1"}
    assert cpu.env({"PATH": "/bin"}) == base


def test_unknown_backend_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        run_suite.build_steps("tpu")
    with pytest.raises(SystemExit):
        run_suite.main(["--backend", "tpu", "--dry-run"])
