"""Run the test suite one CI leg needs, and exit with pytest's exit code.

    python ci/run_suite.py --backend {cpu,cuda,rocm} [--dry-run] [--jobs N] [--arch gfxNNN]
                           [-- extra pytest args]

- cpu:  the cpu-safe suite, ``-m "not gpu"``, Triton in interpreter mode, spread with xdist.
- cuda: ``-m gpu`` (bf16 + fp8 kernels, CUDA graphs at T=1; one device, no multi-rank GPU
        runs), then the cpu-safe suite; both always run, the first non-zero exit code is
        returned.
- rocm: ``-m gpu``; fp8 tests are deselected (``-k "not fp8"``) when SPLASH_NO_FP8=1 or the
        device is a gfx936 (Hygon BW1000 DCU), which has no native fp8.

Each command is printed before it runs; ``--dry-run`` only prints. GPU steps run serially and
with TRITON_INTERPRET unset, so the kernels are compiled for the device.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ("cpu", "cuda", "rocm")
NO_FP8_ARCHS = ("gfx936",)  # ROCm/DTK devices without native fp8


@dataclass(frozen=True)
class Step:
    """One pytest run: its argv and how its environment differs from ours."""

    argv: list[str]
    set_env: dict[str, str] = field(default_factory=dict)
    unset_env: tuple[str, ...] = ()

    def env(self, base: Mapping[str, str]) -> dict[str, str]:
        env = {k: v for k, v in base.items() if k not in self.unset_env}
        env.update(self.set_env)
        return env

    def shell(self) -> str:
        """The command as one copy-pasteable shell line."""
        prefix = [f"env -u {name}" for name in self.unset_env]
        prefix += [f"{k}={shlex.quote(v)}" for k, v in self.set_env.items()]
        return " ".join(prefix + [shlex.join(self.argv)])


def _pytest(*args: str, extra: Sequence[str] = ()) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", *args, *extra, "tests"]


def cpu_step(jobs: str, extra: Sequence[str] = ()) -> Step:
    return Step(
        _pytest("-n", jobs, "-m", "not gpu", extra=extra), set_env={"TRITON_INTERPRET": "1"}
    )


def gpu_step(no_fp8: bool, extra: Sequence[str] = ()) -> Step:
    args = ["-m", "gpu"] + (["-k", "not fp8"] if no_fp8 else [])
    # SPLASH_TEST_GPU tells tests/conftest.py not to default TRITON_INTERPRET on
    return Step(_pytest(*args, extra=extra), set_env={"SPLASH_TEST_GPU": "1"},
                unset_env=("TRITON_INTERPRET",))


def detect_gfx_arch() -> str:
    """The gfx name of GPU 0 ('' when none is found): torch first, then rocminfo."""
    try:
        import torch

        if torch.cuda.is_available():
            name = getattr(torch.cuda.get_device_properties(0), "gcnArchName", "")
            if name:
                return str(name).split(":")[0]
    except Exception:  # a broken torch install must not hide the rocminfo answer
        pass
    try:
        out = subprocess.run(["rocminfo"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    match = re.search(r"\bgfx[0-9a-f]+\b", out)
    return match.group(0) if match else ""


def rocm_needs_no_fp8(env: Mapping[str, str], arch: str | None) -> bool:
    if env.get("SPLASH_NO_FP8", "") == "1":
        return True
    arch = detect_gfx_arch() if arch is None else arch
    return arch.startswith(NO_FP8_ARCHS)


def build_steps(
    backend: str,
    *,
    jobs: str = "auto",
    arch: str | None = None,
    env: Mapping[str, str] | None = None,
    extra: Sequence[str] = (),
) -> list[Step]:
    """The pytest runs of one CI leg, in order. ``arch`` None means: detect it (rocm only)."""
    env = os.environ if env is None else env
    if backend == "cpu":
        return [cpu_step(jobs, extra)]
    if backend == "cuda":
        return [gpu_step(no_fp8=False, extra=extra), cpu_step(jobs, extra)]
    if backend == "rocm":
        return [gpu_step(no_fp8=rocm_needs_no_fp8(env, arch), extra=extra)]
    raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", required=True, choices=BACKENDS)
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--jobs", default="auto", help="xdist workers for the cpu-safe suite")
    parser.add_argument("--arch", default=None, help="gfx arch to assume (rocm; default: detect)")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args(argv)

    steps = build_steps(args.backend, jobs=args.jobs, arch=args.arch, extra=args.pytest_args)
    rc = 0
    for step in steps:
        print(f"+ {step.shell()}", flush=True)
        if args.dry_run:
            continue
        step_rc = subprocess.call(step.argv, cwd=REPO_ROOT, env=step.env(os.environ))
        rc = rc or step_rc
    return rc


if __name__ == "__main__":
    sys.exit(main())
