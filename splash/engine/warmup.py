"""Start-up warm-up: the engine serves a few short requests in every layout it may use, so
Triton compiles its kernels (and the first CUDA graphs are captured) before a user's first
request pays for it; then every trace of the warm-up is forgotten."""

from __future__ import annotations

import time
from typing import Any

from splash.logging_utils import get_logger
from splash.sampling_params import SamplingParams

logger = get_logger("splash.engine")
SHORT = 3  # prompt tokens of the second round (+ 4 drawn: within any index_topk)


def warm_up(engine: Any, layouts: list[str] | None = None) -> float:
    """Compile ``engine``'s kernels before the first user request: in each of ``layouts``
    (default: every layout the engine may use — all that fit under auto, else its own) serve
    one request per rank (two prefill chunks, or one whole budget without chunked prefill,
    then decode steps), then one short request per rank (a DSA model's dense steps), then the
    first requests again (from the prefix cache), then return to the start layout and forget
    it all (counters, switch history, prefix cache). Seconds."""
    start = engine.layout
    if layouts is None:
        layouts = list(engine.setup.fitting) if engine.auto is not None else [start]
    order = [start] + [n for n in layouts if n != start] if start in layouts else layouts
    policy, engine.switches.policy = engine.switches.policy, None  # no pins, no decisions
    t0 = time.perf_counter()
    budget = engine.scheduler.cfg.max_num_batched_tokens
    # two prefill chunks; without chunked prefill a prompt must fit one step's budget whole
    chunks = budget + 17 if engine.scheduler.cfg.enable_chunked_prefill else budget
    length = max(1, min(chunks, engine.setup.max_model_len - 4,
                        engine.setup.max_request_tokens - 4))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    vocab = max(engine.vocab_size - 2, 1)
    try:
        for i, name in enumerate(order):
            logger.info("compiling kernels: layout %s [%d/%d] (prefill chunk + decode)...",
                        name, i + 1, len(order))
            t1 = time.perf_counter()
            if name != engine.layout:
                engine.switches.request(name)
            # one request per owner rank, long (two prefill chunks), then short: a DSA model
            # attends densely only while every history of the step is within index_topk; then
            # the long prompts again, their pages from the prefix cache: a few rows over a
            # cached history (absorbed attention, which a fresh prompt's chunk may not take)
            for turn, size in enumerate((length, min(SHORT, length), length)):
                for rank in range(engine.world):
                    prompt = [2 + (rank * 7919 + j) % vocab for j in range(size)]
                    engine.add_request(prompt, params,
                                       request_id=f"warm-up-{name}-{rank}-{turn}")
                while engine.has_unfinished():
                    engine.step()
            logger.info("compiling kernels: layout %s [%d/%d] done in %.1f s", name, i + 1,
                        len(order), time.perf_counter() - t1)
        if engine.layout != start:
            engine.switches.request(start)
            engine.step()
    finally:
        engine.switches.policy = policy
    engine.reset_counters()
    seconds = time.perf_counter() - t0
    logger.info("kernels ready: %d layout(s) warmed in %.1f s", len(order), seconds)
    return seconds
