"""The controller's gather of one step's results survives a Ctrl-C in the middle: a result
taken off the socket before the interrupt is kept for the next gather (the engine's shutdown
drains the step in flight), not lost, which left that gather waiting for a result that had
already come until the step timeout."""

from __future__ import annotations

import collections

import pytest

from splash.core.protocol import WORKER_PROTOCOL_VERSION, StepResult, encode
from splash.engine.executor import MPExecutor


class _Alive:
    exitcode = None

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
