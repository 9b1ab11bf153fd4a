"""RequestOutput: what generate() returns and what the engine reports per step."""

from __future__ import annotations

import msgspec


class RequestOutput(msgspec.Struct):
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every generated token so far
    new_token_ids: list[int] = []  # tokens produced by the step that made this output
    finished: bool = False
    finish_reason: str | None = None  # "length" | "stop" | "abort" | "error"
    error: str | None = None  # message when finish_reason == "error"
    text: str | None = None  # decoded text when the checkpoint has a tokenizer
