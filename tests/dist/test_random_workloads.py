"""Seeded random serving at T=2 over gloo: requests arrive over the steps (some sharing a
history, some with n samples, seeded sampling or stop tokens), some are aborted, layout
switches are forced at random steps in a random switch mode, the KV pool is small enough that
requests are preempted, and a second round reuses the first's history from the prefix cache.
Every request that was not aborted gives the tokens and finish reason of the same request run
at T=1 with no switch and no prefix cache (an aborted one a prefix of them); the pool is
empty afterwards.

Also a driver for longer hunts, one line a seed, every tiny architecture (DSA included):
``PYTHONPATH=tests TRITON_INTERPRET=1 python tests/dist/test_random_workloads.py 0 1 2 ...``
(about a minute a seed on two cores)."""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass

import msgspec
import pytest
from tiny_models import DEV, checkpoint

from splash import LLM, SamplingParams
from splash.errors import InvalidRequestError

LAYOUTS = ["tp", "dp", "cp", "dop"]


@dataclass
class Job:
    prompt: list[int]
    params: SamplingParams
    arrive: int  # steps after its round starts
    abort: int | None  # abort it this many steps after its round starts


def _round(rng: random.Random, history: list[int]) -> list[Job]:
    jobs = []
    for _ in range(rng.randrange(6, 12)):
        if rng.random() < 0.3:  # shares a page-crossing part of the history
            prompt = history[:rng.randrange(1, len(history) + 1)] + [
                rng.randrange(2, 256) for _ in range(rng.randrange(0, 6))]
        else:
            prompt = [rng.randrange(2, 256) for _ in range(rng.choice([1, 3, 4, 8, 17, 40, 90]))]
        n = rng.choice([1, 1, 1, 2, 3])
        kw: dict = dict(max_tokens=rng.randrange(1, 32), ignore_eos=True, temperature=0.0)
        if n > 1 or rng.random() < 0.2:
            kw.update(temperature=0.9, seed=rng.randrange(100), n=n)
        if rng.random() < 0.2:
            kw["stop_token_ids"] = [rng.randrange(2, 256) for _ in range(3)]
        jobs.append(Job(prompt, SamplingParams(**kw), rng.randrange(0, 12),
                        rng.randrange(1, 20) if rng.random() < 0.15 else None))
    return jobs


@dataclass
class Case:
    arch: str
    mode: str
    layout: str
    page_size: int
    pages: int
    chunk: int
    switches: dict[int, str]  # engine step -> layout asked for
    rounds: list[list[Job]]
    options: dict  # engine options beyond the defaults (the T > 1 run's)


def make_case(seed: int, archs: tuple[str, ...] = ("v3", "v2", "v32", "glm-dsa")) -> Case:
    rng = random.Random(seed)
    arch = rng.choice(archs)
    history = [rng.randrange(2, 256) for _ in range(rng.randrange(10, 60))]
    rounds = [_round(rng, history)]
    rounds.append(_round(rng, rounds[0][0].prompt + rounds[0][1].prompt))
    layout = rng.choice([*LAYOUTS, "auto"])
    switches = {rng.randrange(0, 60): rng.choice(LAYOUTS + ["auto"] * (layout == "auto"))
                for _ in range(rng.randrange(2, 16))}
    return Case(arch, rng.choice(["background", "live", "blocking"]), layout,
                rng.choice([4, 8, 16]), rng.choice([16, 24, 40]), rng.choice([8, 16, 64]),
                switches, _with_extras(random.Random(10**6 + seed), rounds),
                _options(random.Random(-1 - seed)))


def _with_extras(rng: random.Random, rounds: list[list[Job]]) -> list[list[Job]]:
    """Some jobs also ask for logprobs, prompt logprobs (a request that skips the prefix
    cache) or a floor of tokens before a stop token counts, drawn from a stream of their own
    (every seed's arrivals, prompts and lengths stay as they were)."""
    for jobs in rounds:
        for job in jobs:
            extra: dict = {}
            if rng.random() < 0.2:
                extra["logprobs"] = rng.randrange(0, 4)
            if rng.random() < 0.15:
                extra["prompt_logprobs"] = rng.randrange(0, 3)
            if job.params.stop_token_ids and rng.random() < 0.5:
                extra["min_tokens"] = rng.randrange(0, job.params.max_tokens + 1)
            if extra:
                job.params = msgspec.structs.replace(job.params, **extra)
    return rounds


def _options(rng: random.Random) -> dict:
    """Engine options the T > 1 run varies, from a stream of their own (so that adding one
    leaves every seed's workload as it was): few running requests, no chunked prefill,
    synchronous scheduling, every layout's projections resident."""
    options = {}
    if rng.random() < 0.25:
        options["max_num_seqs"] = rng.choice([1, 2, 3])
    if rng.random() < 0.2:
        options["enable_chunked_prefill"] = False
    if rng.random() < 0.25:
        options["async_scheduling"] = False
    if rng.random() < 0.25:
        options["resident_projections"] = True
    return options


def _drive(llm: LLM, case: Case) -> list[object]:
    """Runs the rounds one after the other on ``llm``'s engine; per job its final output, or
    the InvalidRequestError that refused it (a request larger than the small pool)."""
    eng, step, results = llm.engine, 0, []
    for jobs in case.rounds:
        ids: dict[int, str | None] = {}
        done: dict[int, object] = {}
        start = step
        while len(done) < len(jobs):
            for i, job in enumerate(jobs):
                if job.arrive == step - start and i not in ids:
                    try:
                        ids[i] = eng.add_request(job.prompt, job.params)
                    except InvalidRequestError as e:
                        ids[i], done[i] = None, e
                if job.abort == step - start and ids.get(i):
                    eng.abort_request(ids[i])
            if step in case.switches:
                eng.switch_layout(case.switches[step])
            for out in eng.step():
                if out.finished:
                    done[next(i for i, rid in ids.items() if rid == out.request_id)] = out
            step += 1
            assert step < 5000, "no progress"
        while eng.has_unfinished():  # a step scheduled ahead, a switch still moving
            eng.step()
            step += 1
        results += [done[i] for i in range(len(jobs))]
    return results


def run_case(case: Case, world: int = 2) -> tuple[list[str], dict]:
    """The case at ``world`` ranks against the T=1 run: (what differs, the engine's stats)."""
    opts = dict(page_size=case.page_size, max_num_batched_tokens=case.chunk, max_model_len=200,
                **DEV)
    jobs = [job for jobs in case.rounds for job in jobs]
    path = checkpoint(case.arch)
    with LLM(path, tp_size=1, layout="tp", enable_prefix_caching=False, **opts) as llm:
        want = llm.generate([j.prompt for j in jobs], [j.params for j in jobs])
    with LLM(path, tp_size=world, layout=case.layout, switch_mode=case.mode,
             kv_pages_per_rank=case.pages, **opts, **case.options) as llm:
        got = _drive(llm, case)
        stats = llm.stats()
    bad = []
    for i, (g, w) in enumerate(zip(got, want)):
        if isinstance(g, InvalidRequestError):
            continue
        gt, wt = [c.token_ids for c in g.outputs], [c.token_ids for c in w.outputs]
        if g.finish_reason == "abort":
            if any(a != b[:len(a)] for a, b in zip(gt, wt)):
                bad.append(f"job {i}: aborted, not a prefix: {gt} vs {wt}")
        elif (gt, g.finish_reason) != (wt, w.finish_reason):
            bad.append(f"job {i}: {gt} {g.finish_reason} ({g.error}) vs {wt} {w.finish_reason}")
        else:
            bad += [f"job {i}: {what}" for what in _logprob_diffs(g, w)]
    if stats["kv_pages_used"] != [0] * world:
        bad.append(f"pages still used: {stats['kv_pages_used']}")
    return bad, stats


def _logprob_diffs(got, want, tol: float = 1e-3) -> list[str]:
    """Where the logprobs asked for differ: per position the same chosen token and top-k
    values within ``tol`` (fp32 sums in another order); the top-k's ids may differ only where
    values tie within it."""
    pairs = [(f"sample {g.index}", g.logprobs, w.logprobs) for g, w in zip(got.outputs, want.outputs)]
    pairs.append(("prompt", got.prompt_logprobs, want.prompt_logprobs))
    diffs = []
    for name, gl, wl in pairs:
        if (gl is None) != (wl is None) or len(gl or []) != len(wl or []):
            diffs.append(f"{name} logprobs: {gl} vs {wl}")
            continue
        for pos, (a, b) in enumerate(zip(gl or [], wl or [])):
            if (a is None) != (b is None) or a is None:
                continue
            va, vb = sorted(a.values()), sorted(b.values())
            if len(va) != len(vb) or any(abs(x - y) > tol for x, y in zip(va, vb)):
                diffs.append(f"{name} logprobs at {pos}: {a} vs {b}")
            elif any(abs(a[t] - b[t]) > tol for t in set(a) & set(b)):
                diffs.append(f"{name} logprobs at {pos}: {a} vs {b}")
    return diffs


# seeds whose runs switch several times, preempt, abort and hit the cache in round two
@pytest.mark.parametrize("seed", [23])
def test_random_serving_matches_one_rank(seed):
    case = make_case(seed, archs=("v3",))
    bad, stats = run_case(case)
    assert not bad, bad
    assert len(stats["switches"]) >= 2 and stats["num_preemptions"] >= 1
    assert stats["prefix_cache_hit_tokens"] > 0


if __name__ == "__main__":
    for seed in map(int, sys.argv[1:]):
        case = make_case(seed)
        bad, stats = run_case(case)
        print("OK " if not bad else "BAD", seed, case.arch, case.mode, case.layout, case.options,
              f"switches={len(stats['switches'])} preemptions={stats['num_preemptions']} "
              f"hits={stats['prefix_cache_hit_tokens']}", *bad, sep="  ", flush=True)
