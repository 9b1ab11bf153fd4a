"""Telling a pause of this process from a silent peer. A loop that waits on its peers and
limits how long they may stay silent must not count time it did not run itself (stopped with
Ctrl-Z and resumed with ``fg``, a suspended machine): their answers wait unread meanwhile."""

from __future__ import annotations

import time

PAUSE_S = 5.0  # a gap this long between turns of a loop that polls far more often is a pause


class PauseClock:
    """Called once a turn of such a loop, ``pause()`` gives the seconds since the last turn
    when they exceed PAUSE_S (the loop did not run: the process was stopped, or one turn's
    own work took that long), else 0."""

    def __init__(self) -> None:
        self.last = time.monotonic()

    def pause(self) -> float:
        now = time.monotonic()
        gap, self.last = now - self.last, now
        return gap if gap > PAUSE_S else 0.0
