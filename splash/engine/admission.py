"""What a request must satisfy before it enters the engine: a clear error up front, never a
failure mid-serving."""

from __future__ import annotations

from typing import Any

from splash.engine.config import EngineConfig
from splash.errors import InvalidRequestError
from splash.sampling_params import SamplingParams


def check_request(prompt: Any, params: Any, cfg: EngineConfig, setup: Any, vocab_size: int,
                  has_tokenizer: bool) -> None:
    """Raise InvalidRequestError naming what is wrong with ``prompt`` (token ids) and
    ``params`` for an engine of ``cfg`` sized as ``setup``."""
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError("params must be a SamplingParams")
    if not isinstance(prompt, (list, tuple)) or len(prompt) == 0:
        raise InvalidRequestError("prompt must be a non-empty list of token ids")
    bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int)
           or not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"token id {bad[0]!r} is not an int in [0, {vocab_size}) (vocab size)")
    total = len(prompt) + params.max_tokens
    if total > setup.max_model_len:
        raise InvalidRequestError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds "
            f"max_model_len {setup.max_model_len}")
    if total > setup.max_request_tokens:
        raise InvalidRequestError(
            f"prompt + max_tokens = {total} tokens does not fit the KV pool "
            f"({setup.max_request_tokens} tokens per request)")
    if not cfg.enable_chunked_prefill and len(prompt) > setup.max_num_batched_tokens:
        raise InvalidRequestError(  # one step computes the whole prompt
            f"prompt ({len(prompt)} tokens) exceeds max_num_batched_tokens "
            f"{setup.max_num_batched_tokens} with chunked prefill off: raise "
            "max_num_batched_tokens or enable chunked prefill")
    if params.stop and not has_tokenizer:
        raise InvalidRequestError("stop strings need a tokenizer and this checkpoint has none; "
                                  "use stop_token_ids")
    if params.n > cfg.max_num_seqs:
        raise InvalidRequestError(
            f"n={params.n} samples exceed max_num_seqs={cfg.max_num_seqs}")
