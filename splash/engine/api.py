"""EngineAPI: what the server and `splash.LLM` need of an engine. `LLMEngine` implements it;
so does the serving tests' stand-in engine, and one conformance test runs against both."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from splash.outputs import RequestOutput
from splash.sampling_params import SamplingParams


@runtime_checkable
class EngineAPI(Protocol):
    """One thread drives an engine: requests in, one ``step()`` at a time, outputs out.

    - ``add_request`` returns the request id; a bad prompt, bad parameters or a used id raise
      InvalidRequestError and change nothing.
    - ``step`` advances every scheduled request by one step and returns one RequestOutput per
      request that advanced or finished (aborted ones included, with finish_reason "abort");
      a dead worker group raises WorkerDiedError.
    - ``abort_request`` is False for an unknown or finished id.
    - ``switch_layout(name, after_steps)`` switches before the engine step ``after_steps``
      steps from now (under layout="auto" the layout stays pinned until ``switch_layout("auto")``
      releases it); an unknown name raises InvalidRequestError, one that does not fit the
      model or group LayoutInfeasibleError.
    - ``update_weights(path_or_mapping)`` loads new weights of the same architecture in place
      between rounds; with requests in flight it raises InvalidRequestError and changes
      nothing.
    - ``stats`` holds at least: layout, switches, kv_capacity_tokens, kv_pages_used,
      kv_pages_total, num_waiting, num_running, step_time_ms_ema, tokens_per_s, worker_pids.
    """

    tokenizer: Any  # a Hugging Face tokenizer, or None (token ids only)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str: ...

    def abort_request(self, request_id: str) -> bool: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished(self) -> bool: ...

    def switch_layout(self, name: str, after_steps: int = 0) -> None: ...

    def update_weights(self, source: Any) -> dict[str, Any]: ...

    def stats(self) -> dict[str, Any]: ...

    def is_healthy(self) -> bool: ...

    def shutdown(self) -> None: ...
