"""The controller's gather of one step's results survives a Ctrl-C in the middle: a result
taken off the socket before the interrupt is kept for the next gather (the engine's shutdown
drains the step in flight), not lost, which left that gather waiting for a result that had
already come until the step timeout. A pause of the controller itself (Ctrl-Z, then fg) does
not count against the workers' time to answer, which declared them dead for it; silent workers
still time out."""

from __future__ import annotations

import collections

import pytest

import splash.core.pause as pause_module
import splash.engine.executor as executor_module
from splash.core.protocol import WORKER_PROTOCOL_VERSION, StepResult, encode
from splash.engine.executor import MPExecutor
from splash.errors import WorkerDiedError


class _Alive:
    exitcode = None
    pid = None

    def is_alive(self) -> bool:
        return True


class _Socket:
    """Results of ranks in arrival order; the poll after ``interrupt_at`` messages raises
    KeyboardInterrupt once (where a real Ctrl-C lands: between messages)."""

    def __init__(self, arrivals: list[tuple[int, int]], interrupt_at: int) -> None:
        self.queue = collections.deque(arrivals)
        self.taken, self.interrupt_at = 0, interrupt_at

    def poll(self, timeout_ms: int) -> bool:
        if self.taken == self.interrupt_at:
            self.interrupt_at = -1
            raise KeyboardInterrupt
        return bool(self.queue)

    def recv_multipart(self) -> list[bytes]:
        rank, step = self.queue.popleft()
        self.taken += 1
        result = StepResult(version=WORKER_PROTOCOL_VERSION, step=step, rank=rank)
        return [f"worker-{rank}".encode(), encode(result)]


def _executor(sock: _Socket) -> MPExecutor:
    ex = MPExecutor.__new__(MPExecutor)  # no workers: the gather's bookkeeping only
    ex.world, ex.sock, ex.procs, ex._early = 2, sock, [_Alive(), _Alive()], {}
    return ex


@pytest.mark.parametrize("interrupt_at", [1, 2])
def test_results_taken_before_an_interrupt_are_kept(interrupt_at):
    # rank 0 answers steps 5 and 6 before rank 1 answers step 5
    sock = _Socket([(0, 5), (0, 6), (1, 5), (1, 6)], interrupt_at)
    ex = _executor(sock)
    with pytest.raises(KeyboardInterrupt):
        ex._gather(1.0, "step 5")
    first = ex._gather(1.0, "step 5")
    second = ex._gather(1.0, "step 6")
    assert [(r.rank, r.step) for r in first] == [(0, 5), (1, 5)]
    assert [(r.rank, r.step) for r in second] == [(0, 6), (1, 6)]


class _Clock:
    """The executor's time: ``monotonic`` reads it, ``sleep`` and each poll advance it."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class _PausedSocket:
    """Each poll takes its 0.2 s, the first ``pause_s`` more (the controller stopped with
    Ctrl-Z while the step's plans were still on their way); the ranks' results come from
    the poll numbered ``answer_at`` on (never, with None)."""

    def __init__(self, clock: _Clock, pause_s: float, answer_at: int | None) -> None:
        self.clock, self.pause_s, self.answer_at, self.polls = clock, pause_s, answer_at, 0
        self.queue = collections.deque([(0, 7), (1, 7)])

    def poll(self, timeout_ms: int) -> bool:
        self.polls += 1
        self.clock.now += timeout_ms / 1e3 + (self.pause_s if self.polls == 1 else 0.0)
        return self.answer_at is not None and self.polls >= self.answer_at and bool(self.queue)

    def recv_multipart(self) -> list[bytes]:
        rank, step = self.queue.popleft()
        result = StepResult(version=WORKER_PROTOCOL_VERSION, step=step, rank=rank)
        return [f"worker-{rank}".encode(), encode(result)]


def test_a_pause_of_the_controller_does_not_count_against_its_workers(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(executor_module, "time", clock)
    monkeypatch.setattr(pause_module, "time", clock)
    # stopped for 100 s during a 60 s wait; the workers answer 1 s after it resumes
    ex = _executor(_PausedSocket(clock, pause_s=100.0, answer_at=6))
    results = ex._gather(60.0, "step 7")
    assert [(r.rank, r.step) for r in results] == [(0, 7), (1, 7)]


@pytest.mark.parametrize("pause_s", [0.0, 100.0])
def test_silent_workers_still_time_out(monkeypatch, pause_s):
    clock = _Clock()
    monkeypatch.setattr(executor_module, "time", clock)
    monkeypatch.setattr(pause_module, "time", clock)
    sock = _PausedSocket(clock, pause_s=pause_s, answer_at=None)
    ex = _executor(sock)
    with pytest.raises(WorkerDiedError, match="did not answer within 60 s during step 7"):
        ex._gather(60.0, "step 7")
    # the wait ran 60 s of polls after the pause, not fewer and not many more
    assert 300 <= sock.polls <= 302
