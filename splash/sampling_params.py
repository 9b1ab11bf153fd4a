"""SamplingParams (vLLM's names): validated at construction, so a bad value is a clear
InvalidRequestError before anything is scheduled."""

from __future__ import annotations

import math

import msgspec

from splash.errors import InvalidRequestError

MAX_LOGPROBS = 20  # top-k logprobs per position, at most (vLLM's default limit)
MAX_N = 1024  # samples per prompt, at most (the engine also caps n at max_num_seqs)
_MASK64 = (1 << 64) - 1


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    max_tokens: int = 16  # new tokens to generate, >= 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int = 0  # 0 = off, else keep the k most likely tokens
    seed: int | None = None  # per-request seed: same seed, same tokens
    stop_token_ids: list[int] | None = None  # finish ("stop") when one is sampled
    ignore_eos: bool = False  # keep going past the model's EOS
    n: int = 1  # samples per prompt: the prompt is prefilled once, the samples share its KV
    logprobs: int | None = None  # per generated token: the chosen token's logprob + the top-k
    prompt_logprobs: int | None = None  # per prompt token (after the first): same, for the prompt
    stop: str | list[str] | None = None  # finish ("stop") when the text contains one (cut off)
    min_tokens: int = 0  # no EOS, stop token or stop string before this many tokens

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
        if not 1 <= self.n <= MAX_N:
            raise InvalidRequestError(f"n must lie in [1, {MAX_N}], got {self.n}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise InvalidRequestError(f"{name} must lie in [0, {MAX_LOGPROBS}], got {k}")
        if isinstance(self.stop, str):  # vLLM accepts one string too
            msgspec.structs.force_setattr(self, "stop", [self.stop])
        if self.stop is not None and any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop must be a list of non-empty strings")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must lie in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")


def sample_seed(seed: int | None, index: int) -> int | None:
    """Seed of sample ``index`` of an n-sample request: sample 0 keeps the request's seed (so it
    draws what the same request with n=1 draws); every other sample gets its own stream."""
    if seed is None or index == 0:
        return seed
    z = (seed * 0xBF58476D1CE4E5B9 + index * 0x9E3779B97F4A7C15 + 0x5851F42D4C957F2D) & _MASK64
    z = ((z ^ (z >> 31)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 29)) & 0x7FFF_FFFF_FFFF_FFFF
