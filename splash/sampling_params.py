"""SamplingParams (vLLM's names): validated at construction, so a bad value is a clear
InvalidRequestError before anything is scheduled."""

from __future__ import annotations

import math

import msgspec

from splash.errors import InvalidRequestError


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    max_tokens: int = 16  # new tokens to generate, >= 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int = 0  # 0 = off, else keep the k most likely tokens
    seed: int | None = None  # per-request seed: same seed, same tokens
    stop_token_ids: list[int] | None = None  # finish ("stop") when one is sampled
    ignore_eos: bool = False  # keep going past the model's EOS

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise InvalidRequestError(f"max_tokens must be an int, got {self.max_tokens!r}")
        if self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (0 disables), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequestError(f"seed must lie in [0, 2**63), got {self.seed}")
        if self.stop_token_ids is not None and any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be non-negative token ids")
