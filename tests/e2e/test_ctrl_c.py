"""Ctrl-C in a terminal sends SIGINT to the whole process group: the controller and every
worker. Workers ignore it; the controller stops them. `splash serve` exits 0 (its documented
clean stop), `splash generate` exits 130 (interrupted), neither prints a traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from serve_helpers import REPO, ServeProcess
from tiny_models import checkpoint

from splash.client import Client
from splash.errors import SplashError
from splash.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
CPU_TP2 = ["--tp", "2", "--backend", "cpu", "--layout", "tp"]


def _clean(log: str) -> None:
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log[-3000:]


def test_ctrl_c_stops_serve_during_a_stream(tmp_path: Path) -> None:
    server = ServeProcess([*CPU_TP2, "--port", "0", "--model", checkpoint("v3")],
                          tmp_path / "serve.log")
    try:
        with Client(server.zmq_addr, timeout=60) as c:
            stream = c.stream([2, 7], SamplingParams(max_tokens=200, ignore_eos=True))
            assert next(stream)
            os.killpg(server.proc.pid, signal.SIGINT)
            with pytest.raises(SplashError, match="shutting down"):
                list(stream)
        assert server.proc.wait(60) == 0
        _clean(server.log())
    finally:
        server.stop()


def _sigint_default() -> None:
    """In the child before exec: SIGINT at its default, as a terminal starts a command (a
    test runner's worker may ignore it, and an ignored SIGINT is inherited)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _ignores_sigint(pid: int) -> bool:
    """Whether process ``pid`` ignores SIGINT (a disposition children inherit)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))
    return bool(mask >> (signal.SIGINT - 1) & 1)


def _interrupted_generate() -> tuple[subprocess.Popen, str, bool]:
    """Run `splash generate`, Ctrl-C it once its workers are ready; (process, its stderr,
    whether it was still running when the signal went out)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "splash.cli", "generate", "--model", checkpoint("v3"), *CPU_TP2,
         "--prompt-ids", "2,7", "--max-tokens", "250"],  # the model's limit is 256 tokens
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, env={**os.environ, "SPLASH_LOG_LEVEL": "DEBUG"},
        preexec_fn=_sigint_default)
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:  # interrupt once the workers run steps
        seen.append(line)
        if "workers ready" in line:
            break
    running = proc.poll() is None
    ignored = running and _ignores_sigint(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:  # say which: the command, or a child holding the pipes
        still = proc.poll() is None
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        who = "the command still ran" if still else "the command exited, a child held its pipes"
        who += f" (SIGINT ignored: the command {ignored}, this test {_ignores_sigint(os.getpid())})"
        pytest.fail(f"no exit 120 s after Ctrl-C: {who}\n" + ("".join(seen) + err)[-8000:])
    return proc, "".join(seen) + err, running


def test_ctrl_c_stops_generate() -> None:
    for _ in range(3):  # a loaded machine may read the log only after the run has ended
        proc, log, running = _interrupted_generate()
        if running:
            break
    assert running, "the command ended before the test could interrupt it, three times"
    assert proc.returncode == 130, log[-3000:]
    _clean(log)
    # its last word (extensions may still report leaks at interpreter exit, after it)
    assert "splash generate: interrupted" in log.splitlines(), log[-3000:]


def test_ctrl_c_during_start_up_stops_the_workers(monkeypatch) -> None:
    """A Ctrl-C after the workers are up but before the engine is built (here while the
    tokenizer loads) stops them: none outlives the interrupted start (they ignore SIGINT, so
    one left behind would keep the process from exiting)."""
    from splash import LLM
    from splash.engine import llm_engine

    started = []
    spawn = llm_engine.start_executor
    monkeypatch.setattr(llm_engine, "start_executor",
                        lambda *a, **k: started.append(spawn(*a, **k)) or started[-1])

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(llm_engine, "load_tokenizer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        LLM(checkpoint("v3"), tp_size=2, backend="cpu", layout="tp")
    assert started and started[0].procs
    assert not any(p.is_alive() for p in started[0].procs)
