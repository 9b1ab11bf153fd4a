"""`splash.LLM`: offline generation (vLLM's names), driving the engine through EngineAPI."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from splash.engine.api import EngineAPI
from splash.engine.config import EngineConfig
from splash.engine.llm_engine import LLMEngine
from splash.errors import NO_TOKENIZER, InvalidRequestError
from splash.outputs import RequestOutput
from splash.sampling_params import SamplingParams


class LLM:
    """An engine on ``tp_size`` ranks. ``layout`` is fixed ("tp", "dp", "cp", "dop") or "auto"
    (the policy follows the best feasible layout as the batch changes)."""

    def __init__(self, model: str, tp_size: int = 1, backend: str = "auto", layout: str = "auto",
                 **engine_kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, tp_size=tp_size, backend=backend,
                                             layout=layout, **engine_kwargs))

    def generate(
        self,
        prompts: Sequence[Sequence[int] | str],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        layout_plan: Sequence[tuple[int, str]] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns outputs in prompt order. ``layout_plan`` forces
        live switches at engine steps counted from this call: ``[(3, "dop"), (6, "tp")]``."""
        eng: EngineAPI = self.engine
        if isinstance(prompts, (str, bytes)) or (prompts and isinstance(prompts[0], int)):
            raise InvalidRequestError("prompts must be a list of prompts (lists of token ids)")
        params = sampling_params if sampling_params is not None else SamplingParams()
        per_prompt: list[SamplingParams] = (
            list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts))  # type: ignore[list-item]
        if len(per_prompt) != len(prompts):
            raise InvalidRequestError(
                f"{len(per_prompt)} sampling params for {len(prompts)} prompts")
        for step, name in layout_plan or []:
            eng.switch_layout(name, after_steps=int(step))
        ids = [eng.add_request(self._tokens(p), sp) for p, sp in zip(prompts, per_prompt)]
        done: dict[str, RequestOutput] = {}
        pending = set(ids)
        while pending:
            for out in eng.step():
                if out.finished and out.request_id in pending:
                    done[out.request_id] = out
                    pending.discard(out.request_id)
        return [done[i] for i in ids]

    def _tokens(self, prompt: Sequence[int] | str) -> list[int]:
        if isinstance(prompt, str):
            if self.engine.tokenizer is None:
                raise InvalidRequestError(f"{NO_TOKENIZER}: pass token ids")
            return list(self.engine.tokenizer.encode(prompt))
        return list(prompt)

    def update_weights(self, source: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
        """Load new weights of the same architecture in place, between ``generate`` calls: a
        checkpoint directory, or ``{hf_name: tensor}`` (only those tensors change). The prefix
        cache is flushed. Raises (changing nothing) while requests are in flight."""
        return self.engine.update_weights(source)

    def switch_layout(self, name: str) -> None:
        """Switch live at the next step. Under layout="auto" the layout stays pinned until
        ``switch_layout("auto")`` hands the choice back to the policy."""
        self.engine.switch_layout(name)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
