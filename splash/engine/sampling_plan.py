"""What rank 0 computes for a request after a step: its next token's draw (parameters, the
tokens min_tokens holds back, n draws at an n-sample prompt's last row) and the prompt rows it
scores for prompt logprobs. The plan builder sends these; the scheduler reads the results back
in the same order."""

from __future__ import annotations

from collections.abc import Collection

from splash.core.protocol import PromptLogprobs, SeqSampling
from splash.core.request import Request


def seq_sampling(req: Request, eos_token_ids: Collection[int]) -> SeqSampling:
    p = req.params
    banned: list[int] = []
    if req.num_outputs < p.min_tokens:
        banned = sorted((set() if p.ignore_eos else set(eos_token_ids)) | set(p.stop_token_ids or []))
    return SeqSampling(p.temperature, p.top_p, p.top_k, p.seed, p.logprobs, banned, num_draws(req))


def num_draws(req: Request) -> int:
    """Tokens drawn when ``req`` samples next: n at an n-sample prompt's last row, else 1."""
    return req.group.n if req.group is not None and req.fork_pending else 1


def prompt_logprob_rows(req: Request, index: int, start: int, n: int) -> PromptLogprobs | None:
    """The rows of ``req``'s chunk [start, start + n) that score prompt tokens not scored yet
    (the row at position q scores prompt token q + 1); ``index``: the request's in the step."""
    if req.prompt_logprobs is None or req.params.prompt_logprobs is None:
        return None
    prompt = req.prompt_token_ids
    first = max(start, len(req.prompt_logprobs) - 1)
    stop = min(start + n, len(prompt) - 1)
    if first >= stop:
        return None
    return PromptLogprobs(index, first - start, prompt[first + 1:stop + 1], req.params.prompt_logprobs)
