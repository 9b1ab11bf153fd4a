"""Prefix caching and n samples per prompt on rollout traces: the prefill work (prompt tokens
whose KV is computed) and the throughput with the cache on and off.

GRPO (`splash.planning.workloads.grpo`: P prompts x n samples, one template shared by every
prompt, long outputs) runs four ways, all drawing the same tokens (sample i of a prompt is
seeded `sample_seed(seed, i)` in every mode):

- ``independent``: every sample its own request, prefix cache off — what an RL framework gets
  from an engine without these features (each prompt prefilled n times);
- ``cache``: every sample its own request, prefix cache on;
- ``n``: one request per prompt with ``n`` samples (prefilled once, forked), cache off;
- ``cache+n``: both.

Agentic (`splash.planning.workloads.agentic`: sessions of turns, each turn resending the whole
context so far) runs closed loop — a session's next turn is sent when its previous turn
finished, with that turn's output in its context — with the cache off and on.

    python benchmarks/prefix_cache.py --out benchmarks/results/cpu/prefix_cache.json
    python benchmarks/prefix_cache.py --backend cuda --preset deepseek-v2-lite --scale full \\
        --layers 2 --prompts 64 --n 8 --template 1024 --question 512 --output 1024 --page-size 64 \\
        --batch-tokens 8192 --sessions 32 --turns 6 --context 8192 --turn-len 1024 \\
        --out benchmarks/results/h200/prefix_cache.json

The defaults are the CPU run (Triton interpreter: a tiny model, 16 prompts, short lengths, pages
of 4 tokens): the prefill ratios are the engine's, the times are not GPU claims.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
from _results import save_json  # noqa: E402  (benchmarks/ is on sys.path)

sys.path.insert(0, os.path.dirname(__file__))

from splash.planning.workloads import agentic, grpo, summary  # noqa: E402
from splash.sampling_params import SamplingParams, sample_seed  # noqa: E402

GRPO_MODES = ("independent", "cache", "n", "cache+n")
COUNTERS = ("prompt_tokens_computed", "prefix_cache_hit_tokens", "prefix_cache_queried_tokens")


def _engine(path: str, args: Any, cache: bool):
    from splash import LLM

    kw = dict(page_size=args.page_size, max_num_batched_tokens=args.batch_tokens,
              max_num_seqs=args.max_seqs, enable_prefix_caching=cache)
    if args.dtype:
        kw["dtype"] = args.dtype
    llm = LLM(path, tp_size=args.tp, backend=args.backend, layout=args.layout, **kw)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))  # warm-up: kernels, graphs
    return llm


def _counters(llm) -> dict[str, int]:
    s = llm.stats()
    return {k: s[k] for k in COUNTERS}


def _delta(before: dict, after: dict) -> dict[str, int]:
    return {k: after[k] - before[k] for k in before}


def run_grpo(path: str, trace, mode: str, args: Any) -> dict:
    g = torch.Generator().manual_seed(args.seed)
    template = torch.randint(2, args.vocab, (trace[0].common_prefix_len,), generator=g).tolist()
    prompts, params = [], []
    for k, r in enumerate(trace):
        question = torch.randint(2, args.vocab, (r.prompt_len - r.common_prefix_len,),
                                 generator=g).tolist()
        prompt, seed = template[:r.common_prefix_len] + question, args.seed * 100_003 + k
        if mode.endswith("n"):
            prompts.append(prompt)
            params.append(SamplingParams(max_tokens=r.output_len, temperature=1.0, seed=seed,
                                         n=r.n, ignore_eos=True))
        else:
            prompts += [prompt] * r.n
            params += [SamplingParams(max_tokens=r.output_len, temperature=1.0,
                                      seed=sample_seed(seed, i), ignore_eos=True)
                       for i in range(r.n)]
    with _engine(path, args, cache=mode.startswith("cache")) as llm:
        before = _counters(llm)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - t0
        counts = _delta(before, _counters(llm))
    samples = [c.token_ids for o in outs for c in o.outputs]
    generated = sum(map(len, samples))
    return {"mode": mode, "requests": len(prompts), "elapsed_s": round(elapsed, 3),
            "generated_tokens": generated, "tokens_per_s": round(generated / elapsed, 3),
            **counts, "_samples": samples}


def run_agentic(path: str, trace, cache: bool, args: Any) -> dict:
    g = torch.Generator().manual_seed(args.seed + 1)
    sessions: dict[int, list] = {}
    for r in trace:
        sessions.setdefault(r.prefix_group or 0, []).append(r)
    params = {}
    with _engine(path, args, cache=cache) as llm:
        eng = llm.engine
        before = _counters(llm)
        turn = {s: 0 for s in sessions}
        context: dict[int, list[int]] = {}
        outputs: dict[int, list[list[int]]] = {s: [] for s in sessions}

        def submit(s: int) -> None:
            r = sessions[s][turn[s]]
            prev = sessions[s][turn[s] - 1] if turn[s] else None
            fresh = r.prompt_len - (prev.prompt_len + prev.output_len if prev else 0)
            tokens = context.get(s, []) + torch.randint(2, args.vocab, (max(fresh, 1),),
                                                         generator=g).tolist()
            context[s] = tokens
            params[s] = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
            eng.add_request(tokens, params[s], request_id=f"s{s}-t{turn[s]}")

        t0 = time.perf_counter()
        for s in sessions:
            submit(s)
        generated = 0
        while eng.has_unfinished():
            for out in eng.step():
                if not out.finished:
                    continue
                s = int(out.request_id[1:].split("-")[0])
                outputs[s].append(out.token_ids)
                generated += len(out.token_ids)
                context[s] = context[s] + out.token_ids
                turn[s] += 1
                if turn[s] < len(sessions[s]):
                    submit(s)
        elapsed = time.perf_counter() - t0
        counts = _delta(before, _counters(llm))
    return {"cache": cache, "turns": sum(len(v) for v in sessions.values()),
            "elapsed_s": round(elapsed, 3), "generated_tokens": generated,
            "tokens_per_s": round(generated / elapsed, 3), **counts,
            "_samples": [t for s in sorted(outputs) for t in outputs[s]]}


def _checkpoint(args: Any) -> str:
    from offline_throughput import build_checkpoint

    from splash.model.presets import make_model

    if args.full_dims:
        path = args.model or f"/tmp/splash-prefix-bench-v2lite-{args.layers}"
        build_checkpoint(path, args.layers, torch.bfloat16)
        return path
    path = args.model or f"/tmp/splash-prefix-bench-{args.preset}-{args.scale}-{args.layers}"
    if not os.path.exists(os.path.join(path, "config.json")):
        make_model(path, args.preset, layers=args.layers, seed=0, scale=args.scale)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--layout", default="tp")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: a random preset)")
    ap.add_argument("--preset", default="deepseek-v3")
    ap.add_argument("--scale", default="tiny")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--full-dims", action="store_true", help="DeepSeek-V2-Lite dimensions")
    ap.add_argument("--vocab", type=int, default=250, help="prompt token ids drawn below this")
    ap.add_argument("--page-size", type=int, default=4)
    ap.add_argument("--batch-tokens", type=int, default=256)
    ap.add_argument("--max-seqs", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--template", type=int, default=32, help="tokens every prompt shares")
    ap.add_argument("--question", type=int, default=16, help="median question tokens")
    ap.add_argument("--output", type=int, default=8, help="median output tokens")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--context", type=int, default=48, help="median first-turn context")
    ap.add_argument("--turn-len", type=int, default=12, help="median new tokens per turn")
    ap.add_argument("--skip-agentic", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/cpu/prefix_cache.json")
    args = ap.parse_args()
    path = _checkpoint(args)
    result: dict[str, Any] = {"benchmark": "prefix_cache", "backend": args.backend,
                              "tp": args.tp, "layout": args.layout, "model": path,
                              "page_size": args.page_size, "batch_tokens": args.batch_tokens}

    trace = grpo(prompts=args.prompts, n=args.n, seed=args.seed, template_len=args.template,
                 question_median=args.question, output_median=args.output,
                 max_question=4 * args.question, max_output=4 * args.output)
    runs = []
    for mode in GRPO_MODES:
        r = run_grpo(path, trace, mode, args)
        print(f"grpo {mode:>11}: prefill {r['prompt_tokens_computed']:>8} tokens, "
              f"{r['tokens_per_s']:9.2f} tokens/s, {r['elapsed_s']:8.2f} s", flush=True)
        runs.append(r)
    base, samples = runs[0], [r.pop("_samples") for r in runs]
    for r, s in zip(runs, samples):
        r["same_tokens_as_independent"] = s == samples[0]
        r["prefill_vs_independent"] = round(r["prompt_tokens_computed"]
                                            / base["prompt_tokens_computed"], 4)
        r["throughput_vs_independent"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
    result["grpo"] = {"trace": summary(trace), "runs": runs}

    if not args.skip_agentic:
        trace = agentic(sessions=args.sessions, turns=args.turns, seed=args.seed,
                        prefix_len=args.context, turn_len=args.turn_len,
                        output_median=args.output, max_output=4 * args.output)
        off, on = (run_agentic(path, trace, cache, args) for cache in (False, True))
        on["same_tokens_as_cache_off"] = on.pop("_samples") == off.pop("_samples")
        on["prefill_vs_cache_off"] = round(on["prompt_tokens_computed"]
                                           / off["prompt_tokens_computed"], 4)
        on["throughput_vs_cache_off"] = round(on["tokens_per_s"] / off["tokens_per_s"], 3)
        for r in (off, on):
            print(f"agentic cache {'on ' if r['cache'] else 'off'}: prefill "
                  f"{r['prompt_tokens_computed']:>8} tokens, {r['tokens_per_s']:9.2f} tokens/s",
                  flush=True)
        result["agentic"] = {"trace": summary(trace), "runs": [off, on]}
    if args.backend == "cpu":
        result["note"] = "CPU (Triton interpreter): the prefill ratios are the engine's; " \
                         "times are not GPU claims"
    save_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
