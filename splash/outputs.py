"""RequestOutput: what generate() returns and what the engine reports per step."""

from __future__ import annotations

import msgspec

# one position's logprobs: {token id: logprob} holding the chosen (or prompt) token and the top-k
Logprobs = dict[int, float]


class CompletionOutput(msgspec.Struct):
    """One of a request's n samples."""

    index: int  # sample index in [0, n)
    token_ids: list[int]  # every token generated so far
    new_token_ids: list[int] = []  # tokens produced by the step that made this output
    finished: bool = False
    finish_reason: str | None = None  # "length" | "stop" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that finished it
    text: str | None = None  # decoded text (the stop string cut off) when there is a tokenizer
    logprobs: list[Logprobs] | None = None  # per generated token, when logprobs=k was asked


class RequestOutput(msgspec.Struct):
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every generated token so far (sample 0 when n > 1)
    new_token_ids: list[int] = []  # tokens produced by the step that made this output
    finished: bool = False  # every sample finished
    finish_reason: str | None = None  # "length" | "stop" | "abort" | "error"
    error: str | None = None  # message when finish_reason == "error"
    text: str | None = None  # decoded text when the checkpoint has a tokenizer
    stop_reason: int | str | None = None  # the stop token id or stop string that finished it
    logprobs: list[Logprobs] | None = None  # per generated token (sample 0), when asked
    prompt_logprobs: list[Logprobs | None] | None = None  # per prompt token; the first is None
    outputs: list[CompletionOutput] = []  # the n samples (one when n == 1); sample 0 is above
