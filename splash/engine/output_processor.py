"""From sampled tokens to finished requests and RequestOutputs.

A request finishes ("stop") on the model's EOS (unless ignore_eos), on one of its
``stop_token_ids`` or when its text comes to contain one of its ``stop`` strings, and
("length") at ``max_tokens`` or the model length. Before ``min_tokens`` tokens none of the
stops count (the worker never draws EOS or a stop token id then). Stop strings are searched in
incrementally detokenized text, only where the newest text could complete one; the text is cut
before the stop string (as vLLM does), the token ids keep the token that completed it. The
n samples of a prompt are reported as one RequestOutput whose ``outputs`` hold each sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from splash.core.protocol import TokenLogprobs
from splash.core.request import Request, Status
from splash.detokenize import IncrementalDetokenizer
from splash.outputs import CompletionOutput, RequestOutput


@dataclass
class _Text:
    """Incremental text of a request with stop strings."""

    detok: IncrementalDetokenizer
    longest_stop: int
    text: str = ""
    stopped: bool = False  # cut at a stop string: no more text follows


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_token_ids: frozenset[int] | set[int] | tuple[int, ...],
                 max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self._texts: dict[Request, _Text] = {}

    def start(self, req: Request) -> None:
        """Set up what a request's outputs need (before its first token)."""
        p = req.params
        if p.logprobs is not None and req.logprobs is None:
            req.logprobs = []
        if p.prompt_logprobs is not None and req.prompt_logprobs is None:
            req.prompt_logprobs = [None]  # the first prompt token has nothing to score it
        if p.stop and self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids)
            self._texts[req] = _Text(detok, max(len(s) for s in p.stop))

    def fork(self, parent: Request, child: Request) -> None:
        """A sample forked off ``parent`` before either generated text."""
        self.start(child)

    def forget(self, req: Request) -> None:
        self._texts.pop(req, None)

    # -- tokens ---------------------------------------------------------------------------
    def append(self, req: Request, token: int, logprobs: TokenLogprobs | None) -> str | None:
        """Add a sampled token; return the finish reason it causes, if any."""
        req.output_token_ids.append(token)
        if req.logprobs is not None and logprobs is not None:
            req.logprobs.append(dict(zip(logprobs.token_ids, logprobs.logprobs)))
        p = req.params
        new_text = self._push_text(req, token)
        if len(req.output_token_ids) >= p.min_tokens:
            if not p.ignore_eos and token in self.eos:
                return "stop"
            if p.stop_token_ids and token in p.stop_token_ids:
                req.stop_reason = token
                return "stop"
            if new_text and self._cut_at_stop(req, len(new_text)):
                return "stop"
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def add_prompt_logprobs(self, req: Request, rows: list[TokenLogprobs]) -> None:
        assert req.prompt_logprobs is not None
        req.prompt_logprobs += [dict(zip(r.token_ids, r.logprobs)) for r in rows]

    def _push_text(self, req: Request, token: int) -> str:
        st = self._texts.get(req)
        if st is None or st.stopped:
            return ""
        new = st.detok.push([token])
        st.text += new
        return new

    def _cut_at_stop(self, req: Request, num_new: int) -> bool:
        st = self._texts[req]
        start = max(len(st.text) - num_new - st.longest_stop + 1, 0)
        hits = [(i, s) for s in req.params.stop or [] if (i := st.text.find(s, start)) >= 0]
        if not hits:
            return False
        cut, stop = min(hits)
        st.text, st.stopped = st.text[:cut], True
        req.stop_reason = stop
        return True

    # -- outputs --------------------------------------------------------------------------
    def output(self, req: Request, new: dict[Request, list[int]] | None = None) -> RequestOutput:
        """The RequestOutput of ``req``'s prompt (all samples of its group) after a step that
        produced ``new`` tokens."""
        new = new or {}
        members = req.group.members if req.group is not None else [req]
        outs = [self._completion(m, new.get(m, [])) for m in members]
        head, first = members[0], outs[0]
        return RequestOutput(
            req.group.request_id if req.group is not None else req.request_id,
            head.prompt_token_ids, first.token_ids, new_token_ids=first.new_token_ids,
            finished=all(o.finished for o in outs), finish_reason=first.finish_reason,
            error=next((m.error for m in members if m.error), None), text=first.text,
            stop_reason=first.stop_reason, logprobs=first.logprobs,
            prompt_logprobs=head.prompt_logprobs, outputs=outs)

    def _completion(self, req: Request, new: list[int]) -> CompletionOutput:
        finished = req.status is Status.FINISHED
        text = self._final_text(req) if finished else None
        return CompletionOutput(
            req.sample_index, list(req.output_token_ids), new_token_ids=new, finished=finished,
            finish_reason=req.finish_reason, stop_reason=req.stop_reason, text=text,
            logprobs=None if req.logprobs is None else list(req.logprobs))

    def _final_text(self, req: Request) -> str | None:
        st = self._texts.get(req)
        if st is not None:
            if not st.stopped:
                st.text += st.detok.finish()
                st.stopped = True
            return st.text
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(req.output_token_ids)
