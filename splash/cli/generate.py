"""`splash generate`: offline generation from the command line."""

from __future__ import annotations

import json
import sys
from typing import Any

from splash.core.ownership import LAYOUT_NAMES
from splash.errors import InvalidRequestError
from splash.llm import LLM
from splash.sampling_params import SamplingParams


def parse_layout_plan(text: str | None) -> list[tuple[int, str]]:
    """'3:dop,6:tp' -> [(3, 'dop'), (6, 'tp')]; checked before any model is loaded."""
    if not text:
        return []
    plan = []
    layouts = list(LAYOUT_NAMES)
    for item in text.split(","):
        step, _, name = item.partition(":")
        if not step.strip().isdigit() or not name:
            raise InvalidRequestError(f"bad --layout-plan item {item!r}; expected STEP:LAYOUT")
        if name.strip() not in layouts:
            raise InvalidRequestError(f"bad --layout-plan item {item!r}: unknown layout "
                                      f"{name.strip()!r}; choose from {', '.join(layouts)}")
        plan.append((int(step), name.strip()))
    return plan


def parse_prompt_ids(items: list[str]) -> list[list[int]]:
    prompts = []
    for item in items:
        try:
            prompts.append([int(t) for t in item.split(",") if t.strip()])
        except ValueError:
            raise InvalidRequestError(f"bad --prompt-ids {item!r}; expected 1,2,3") from None
    return prompts


def generate_main(args: Any) -> int:
    prompts = parse_prompt_ids(args.prompt_ids or []) or [[1, 2, 3]]
    plan = parse_layout_plan(args.layout_plan)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    engine_kw = {k: getattr(args, k) for k in ("dtype", "kv_dtype", "page_size", "max_model_len",
                                                "kv_pages_per_rank", "memory_fraction",
                                                "max_num_seqs", "max_num_batched_tokens")
                 if getattr(args, k, None) is not None}
    if args.enforce_eager:
        engine_kw["enforce_eager"] = True
    if not getattr(args, "async_scheduling", True):
        engine_kw["async_scheduling"] = False
    with LLM(args.model, tp_size=args.tp_size, backend=args.backend, layout=args.layout,
             **engine_kw) as llm:
        outs = llm.generate(prompts, params, layout_plan=plan)
        stats = llm.stats()
    for out in outs:
        if args.json:
            print(json.dumps({"request_id": out.request_id, "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason}))
        else:
            print(f"{out.request_id}: {out.token_ids} ({out.finish_reason})")
    if args.json:
        print(json.dumps({"stats": stats}))
    else:
        print(f"layout {stats['layout']}, switches: "
              f"{[(s['from'], s['to']) for s in stats['switches']]}", file=sys.stderr)
    return 0
