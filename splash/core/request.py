"""A request as the controller tracks it (no device state)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from splash.outputs import Logprobs
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
    stop_reason: int | str | None = None  # the stop token id or stop string that finished it
    error: str | None = None
    num_preemptions: int = 0
    first_token_s: float | None = None
    num_reported: int = 0  # output tokens already handed to the caller
    logprobs: list[Logprobs] | None = None  # per output token, when params.logprobs is set
    prompt_logprobs: list[Logprobs | None] | None = None  # per prompt token scored so far
    group: SampleGroup | None = None  # the n samples this request is one of (n > 1)
    sample_index: int = 0  # its index there
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache keys of full pages
    num_cached_pages: int = 0  # leading full pages registered in the prefix cache
    # a token drawn by a step still in flight (asynchronous scheduling): the next step was
    # scheduled before it is known, and reads it on the workers as draw ``pending_draw`` of
    # that step
    pending: int = 0
    pending_draw: int = -1

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_at(self, i: int) -> int:
        """Token ``i``; the one still in flight reads as ``-1 - pending_draw`` (the workers
        take it from the step that draws it)."""
        n = len(self.prompt_token_ids)
        if i < n:
            return self.prompt_token_ids[i]
        if i - n < len(self.output_token_ids):
            return self.output_token_ids[i - n]
        assert self.pending and i == self.num_tokens, f"token {i} of {self.request_id} unknown"
        return -1 - self.pending_draw

    @property
    def num_outputs(self) -> int:
        """Output tokens drawn so far, the one in flight included."""
        return len(self.output_token_ids) + self.pending

    @property
    def num_pending(self) -> int:
        """Tokens whose KV still has to be computed before the next sample."""
        return self.num_tokens + self.pending - self.num_computed

    @property
    def fork_pending(self) -> bool:
        """The prompt's last row draws the n samples of this request's group."""
        return self.group is not None and len(self.group.members) < self.group.n


@dataclass(eq=False)
class SampleGroup:
    """The n samples of one prompt: the first request prefills it; at its last row n tokens
    are drawn and n - 1 more requests fork off, sharing its pages."""

    request_id: str  # the caller's id
    n: int
    members: list[Request] = field(default_factory=list)  # in sample order

    @property
    def finished(self) -> bool:
        return all(r.status is Status.FINISHED for r in self.members)
