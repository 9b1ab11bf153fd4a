"""Seeded synthetic request traces for the simulator and the benchmarks: rollout (RL rollout:
groups of samples per prompt, long-tailed outputs), grpo, agentic (multi-turn sessions whose
context grows), chat, stationary (one regime) and bursty (arrivals in bursts).

Every generator returns a list of `TraceRequest` sorted by arrival, identical for identical
arguments. Lengths are tokens, arrivals seconds from the start of the run.

    python benchmarks/workloads.py rollout --n 256 --seed 0     # summary statistics

Sharing, for prefix caching: ``prefix_group`` marks requests that continue one history (an
agent session: each turn resends the whole context so far, the previous turns' outputs
included), ``common_prefix_len`` the leading prompt tokens every request of a trace shares
(a system prompt or few-shot template), and ``n`` the samples drawn per prompt (GRPO's group).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from splash.errors import ConfigError


class TraceError(ConfigError):
    """A trace file or trace argument that cannot be used; the message says where and why."""


@dataclass(frozen=True)
class TraceRequest:
    prompt_len: int
    output_len: int
    arrival_s: float = 0.0
    prefix_group: int | None = None  # requests of one group share a prompt prefix
    n: int = 1  # samples per prompt (GRPO's group size)
    common_prefix_len: int = 0  # leading prompt tokens shared by every request of the trace

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.output_len < 1:
            raise TraceError(f"prompt_len and output_len must be >= 1, got {self}")
        if self.n < 1 or not 0 <= self.common_prefix_len <= self.prompt_len:
            raise TraceError(f"n must be >= 1 and common_prefix_len in [0, prompt_len], "
                             f"got {self}")
        if not math.isfinite(self.arrival_s) or self.arrival_s < 0:
            raise TraceError(f"arrival_s must be a finite number >= 0, got {self.arrival_s}")


def _lognormal(rng: np.random.Generator, median: float, sigma: float, n: int, lo: int,
               hi: int) -> np.ndarray:
    return np.clip(np.rint(rng.lognormal(math.log(median), sigma, n)), lo, hi).astype(int)


def _sorted(reqs: list[TraceRequest]) -> list[TraceRequest]:
    return sorted(reqs, key=lambda r: r.arrival_s)


def rollout(n: int = 256, seed: int = 0, prompt_median: int = 1024, output_median: int = 1024,
            output_sigma: float = 1.4, max_prompt: int = 8192, max_output: int = 32768,
            group: int = 8) -> list[TraceRequest]:
    """RL rollout: ``n`` requests, ``group`` samples per prompt (one prompt, ``prefix_group`` =
    the prompt's index, as GRPO draws them), every request at 0; output lengths heavy-tailed
    per sample (lognormal, clipped), so a batch of many short generations ends as a few very
    long ones."""
    if group < 1:
        raise TraceError("group must be >= 1")
    rng = np.random.default_rng(seed)
    num_prompts = -(-n // group)
    prompts = _lognormal(rng, prompt_median, 0.5, num_prompts, 64, max_prompt)
    outputs = _lognormal(rng, output_median, output_sigma, n, 16, max_output)
    return [TraceRequest(int(prompts[i // group]), int(o), 0.0,
                         prefix_group=i // group if group > 1 else None)
            for i, o in enumerate(outputs)]


def grpo(prompts: int = 64, n: int = 8, seed: int = 0, template_len: int = 512,
         question_median: int = 256, output_median: int = 2048, output_sigma: float = 0.8,
         max_question: int = 4096, max_output: int = 16384) -> list[TraceRequest]:
    """A GRPO rollout round: ``prompts`` prompts of ``n`` samples each, all at 0; every prompt
    is a shared template (``template_len`` tokens: instructions, few-shot examples) followed by
    its own question; long, heavy-tailed outputs (one length per prompt)."""
    rng = np.random.default_rng(seed)
    questions = _lognormal(rng, question_median, 0.6, prompts, 8, max_question)
    outputs = _lognormal(rng, output_median, output_sigma, prompts, 16, max_output)
    return [TraceRequest(template_len + int(q), int(o), 0.0, prefix_group=i, n=n,
                         common_prefix_len=template_len)
            for i, (q, o) in enumerate(zip(questions, outputs))]


def agentic(sessions: int = 16, turns: int = 6, seed: int = 0, prefix_len: int = 32768,
            turn_len: int = 2048, output_median: int = 512, gap_s: float = 30.0,
            max_output: int = 4096) -> list[TraceRequest]:
    """Agent sessions: each turn resends the session's growing context (a long shared prefix,
    ``prefix_group`` = session) plus new tool output; turns of all sessions arrive in bursts."""
    rng = np.random.default_rng(seed)
    reqs = []
    for s in range(sessions):
        context = int(prefix_len * rng.uniform(0.5, 1.5))
        for t in range(turns):
            context += int(turn_len * rng.uniform(0.25, 1.75))
            out = int(_lognormal(rng, output_median, 0.8, 1, 16, max_output)[0])
            arrival = t * gap_s + float(rng.exponential(gap_s / 20))
            reqs.append(TraceRequest(context, out, arrival, prefix_group=s))
            context += out
    return _sorted(reqs)


def chat(n: int = 512, seed: int = 0, rate_per_s: float = 8.0, prompt_median: int = 1024,
         output_median: int = 256, max_prompt: int = 32768,
         max_output: int = 4096) -> list[TraceRequest]:
    """Interactive chat: Poisson arrivals, mixed prompt and output lengths."""
    if rate_per_s <= 0:
        raise TraceError("rate_per_s must be > 0")
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate_per_s, n))
    prompts = _lognormal(rng, prompt_median, 1.0, n, 16, max_prompt)
    outputs = _lognormal(rng, output_median, 0.9, n, 8, max_output)
    return [TraceRequest(int(p), int(o), float(a)) for p, o, a in zip(prompts, outputs, arrivals)]


def stationary(n: int = 256, prompt_len: int = 4096, output_len: int = 512,
               rate_per_s: float | None = None, seed: int = 0) -> list[TraceRequest]:
    """Identical requests, all at 0 (``rate_per_s`` None) or Poisson at ``rate_per_s``."""
    rng = np.random.default_rng(seed)
    arrivals = np.zeros(n) if rate_per_s is None else np.cumsum(rng.exponential(1 / rate_per_s, n))
    return [TraceRequest(prompt_len, output_len, float(a)) for a in arrivals]


def bursty(n: int = 256, seed: int = 0, bursts: int = 4, gap_s: float = 20.0,
           burst_span_s: float = 1.0, prompt_median: int = 1024, output_median: int = 256,
           max_prompt: int = 16384, max_output: int = 4096) -> list[TraceRequest]:
    """Arrivals in ``bursts`` bursts ``gap_s`` apart, each spread over ``burst_span_s``: the
    engine goes from idle to a full batch and drains before the next burst."""
    if bursts < 1 or gap_s < 0 or burst_span_s < 0:
        raise TraceError("bursts must be >= 1, gap_s and burst_span_s >= 0")
    rng = np.random.default_rng(seed)
    which = np.sort(rng.integers(0, bursts, n))
    arrivals = which * gap_s + rng.uniform(0, burst_span_s, n)
    prompts = _lognormal(rng, prompt_median, 0.8, n, 16, max_prompt)
    outputs = _lognormal(rng, output_median, 0.8, n, 8, max_output)
    return _sorted([TraceRequest(int(p), int(o), float(a))
                    for p, o, a in zip(prompts, outputs, arrivals)])


def load_jsonl(path: str | Path) -> list[TraceRequest]:
    """One JSON object per line with ``prompt_len``, ``output_len``, ``arrival_s`` (optional,
    default 0) and optional ``prefix_group``, ``n``, ``common_prefix_len``; blank lines and
    ``#`` comments are skipped."""
    reqs = []
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace file {path} does not exist")
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected an object, got {type(obj).__name__}")
        missing = [k for k in ("prompt_len", "output_len") if k not in obj]
        if missing:
            raise TraceError(f"{where}: missing {', '.join(missing)}")
        try:
            vals = {k: obj[k] for k in ("prompt_len", "output_len")}
            if any(not isinstance(v, int) or isinstance(v, bool) for v in vals.values()):
                raise TraceError("prompt_len and output_len must be integers")
            group = obj.get("prefix_group")
            reqs.append(TraceRequest(vals["prompt_len"], vals["output_len"],
                                     float(obj.get("arrival_s", 0.0)),
                                     None if group is None else int(group),
                                     int(obj.get("n", 1)), int(obj.get("common_prefix_len", 0))))
        except (TraceError, TypeError, ValueError) as e:
            raise TraceError(f"{where}: {e}") from None
    if not reqs:
        raise TraceError(f"{path}: no requests")
    return _sorted(reqs)


def scaled(trace: Sequence[TraceRequest], max_prompt: int,
           max_output: int) -> list[TraceRequest]:
    """Shrink lengths proportionally so the longest prompt/output become at most these bounds
    (CPU runs); arrivals and the shape of the distributions are kept."""
    if max_prompt < 1 or max_output < 1:
        raise TraceError("max_prompt and max_output must be >= 1")
    fp = min(1.0, max_prompt / max(r.prompt_len for r in trace))
    fo = min(1.0, max_output / max(r.output_len for r in trace))
    out = []
    for r in trace:
        prompt = max(1, round(r.prompt_len * fp))
        out.append(replace(r, prompt_len=prompt, output_len=max(1, round(r.output_len * fo)),
                           common_prefix_len=min(round(r.common_prefix_len * fp), prompt)))
    return out


GENERATORS: dict[str, Callable[..., list[TraceRequest]]] = {
    "rollout": rollout, "agentic": agentic, "chat": chat, "stationary": stationary,
    "grpo": grpo, "bursty": bursty}


def get_trace(name: str, seed: int = 0, n: int | None = None,
              **params: float) -> list[TraceRequest]:
    """A generator by name (``n`` overrides its request/session count, ``params`` any of its
    other arguments) or a .jsonl path."""
    if name.endswith(".jsonl"):
        return load_jsonl(name)
    if name not in GENERATORS:
        raise TraceError(f"unknown trace {name!r}; choose from {sorted(GENERATORS)} or a .jsonl")
    if n is not None:
        params[{"agentic": "sessions", "grpo": "prompts"}.get(name, "n")] = n
    try:
        return GENERATORS[name](seed=seed, **params)
    except TypeError as e:  # an argument the generator does not take
        raise TraceError(f"trace {name}: {e}") from None


def summary(trace: Sequence[TraceRequest]) -> dict:
    p = np.array([r.prompt_len for r in trace])
    o = np.array([r.output_len for r in trace])
    a = np.array([r.arrival_s for r in trace])

    def stats(x: np.ndarray) -> dict:
        return {"p50": float(np.percentile(x, 50)), "p99": float(np.percentile(x, 99)),
                "max": int(x.max()), "mean": round(float(x.mean()), 1)}

    return {"requests": len(trace), "samples": sum(r.n for r in trace),
            "prompt": stats(p), "output": stats(o),
            "total_tokens": int(p.sum() + o.sum()), "span_s": round(float(a.max() - a.min()), 2),
            "prefix_groups": len({r.prefix_group for r in trace} - {None})}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="print summary statistics of a synthetic trace")
    ap.add_argument("trace", help=f"{sorted(GENERATORS)} or a .jsonl file")
    ap.add_argument("--n", type=int, default=None, help="requests (sessions for agentic)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(json.dumps(summary(get_trace(args.trace, args.seed, args.n)), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
