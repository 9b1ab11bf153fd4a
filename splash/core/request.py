"""A request as the controller tracks it (no device state)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from splash.sampling_params import SamplingParams


class Status(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity: the scheduler's membership tests stay O(1) per comparison
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_s: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is stored
    owner: int = 0  # owner rank under owned-KV layouts
    tables: list[list[int]] = field(default_factory=list)  # per rank: local block table
    status: Status = Status.WAITING
    finish_reason: str | None = None
    error: str | None = None
    num_preemptions: int = 0
    first_token_s: float | None = None
    num_reported: int = 0  # output tokens already handed to the caller

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    @property
    def num_pending(self) -> int:
        """Tokens whose KV still has to be computed before the next sample."""
        return self.num_tokens - self.num_computed
