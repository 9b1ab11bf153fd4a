"""Load test of `splash serve`: N concurrent streaming clients over loopback.

    python benchmarks/serve_load.py                        # self-starts a tiny model, T=2 CPU
    python benchmarks/serve_load.py --addr tcp://127.0.0.1:5557 --clients 64 --requests 512

Each client (its own AsyncClient socket) streams requests one after another from a shared
queue. Reports request and token throughput, TTFT (send → first delta) and TPOT (mean gap
between later tokens) at p50/p99, and writes JSON with machine, versions and date to
``--out`` (default benchmarks/results/cpu/serve_load.json).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import random
import re
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from splash.client import AsyncClient  # noqa: E402
from splash.sampling_params import SamplingParams  # noqa: E402


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


async def _client(addr: str, queue: asyncio.Queue, records: list[dict[str, Any]],
                  timeout: float) -> None:
    async with AsyncClient(addr, timeout=timeout) as c:
        while True:
            try:
                prompt, params = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            t0 = time.perf_counter()
            stamps: list[float] = []
            stream = await c.stream(prompt, params)
            async for delta in stream:
                stamps += [time.perf_counter()] * len(delta)
            records.append({"ttft_s": stamps[0] - t0 if stamps else None,
                            "tpot_s": (stamps[-1] - stamps[0]) / (len(stamps) - 1)
                            if len(stamps) > 1 else None,
                            "latency_s": time.perf_counter() - t0, "tokens": len(stamps)})


async def run_load(addr: str, clients: int, requests: int, prompt_len: int, max_tokens: int,
                   vocab: int, seed: int, timeout: float) -> dict[str, Any]:
    rng = random.Random(seed)
    queue: asyncio.Queue = asyncio.Queue()
    for _ in range(requests):
        prompt = [rng.randrange(2, vocab) for _ in range(rng.randint(1, prompt_len))]
        queue.put_nowait((prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                 ignore_eos=True)))
    records: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    await asyncio.gather(*(_client(addr, queue, records, timeout) for _ in range(clients)))
    wall = time.perf_counter() - t0
    ttft = [r["ttft_s"] * 1e3 for r in records if r["ttft_s"] is not None]
    tpot = [r["tpot_s"] * 1e3 for r in records if r["tpot_s"] is not None]
    tokens = sum(r["tokens"] for r in records)
    return {"requests": len(records), "wall_s": wall, "tokens": tokens,
            "requests_per_s": len(records) / wall, "output_tokens_per_s": tokens / wall,
            "ttft_ms": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
            "tpot_ms": {"p50": percentile(tpot, 50), "p99": percentile(tpot, 99)}}


def _start_server(args: argparse.Namespace, workdir: str) -> tuple[subprocess.Popen, str]:
    model = args.model
    if model is None:
        from splash.model.presets import make_model

        model = str(make_model(Path(workdir) / "tiny", args.preset, layers=2, seed=0,
                               scale="tiny"))
    cmd = [sys.executable, "-m", "splash.cli", "serve", "--model", model, "--tp",
           str(args.tp), "--backend", args.backend, "--port", "0"]
    env = dict(os.environ)
    if args.backend == "cpu":
        env.setdefault("TRITON_INTERPRET", "1")  # CPU kernels run under the Triton interpreter
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        m = re.match(r"splash serve: zmq (\S+)", proc.stdout.readline())
        if m:
            return proc, m.group(1)
    proc.kill()
    raise SystemExit("splash serve did not start")


def _environment() -> dict[str, Any]:
    versions = {}
    for pkg in ("splash-serve", "pyzmq", "msgspec", "torch"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                                capture_output=True, timeout=10).stdout.strip() or None
    except OSError:
        commit = None
    return {"machine": {"platform": platform.platform(), "processor": platform.processor(),
                        "cpu_count": os.cpu_count(), "python": platform.python_version()},
            "versions": versions, "git_commit": commit,
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--addr", default=None, help="running server; default: start one")
    p.add_argument("--model", default=None, help="checkpoint for the self-started server")
    p.add_argument("--preset", default="deepseek-v3", help="tiny preset when no --model")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--backend", default="cpu")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=32, help="max prompt length")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--vocab", type=int, default=256, help="prompt ids are drawn below this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--out", default=str(REPO / "benchmarks/results/cpu/serve_load.json"))
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory() as workdir:
        proc, addr = (None, args.addr) if args.addr else _start_server(args, workdir)
        try:
            result = asyncio.run(run_load(addr, args.clients, args.requests, args.prompt_len,
                                          args.max_tokens, args.vocab, args.seed, args.timeout))
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(60)
    config = {k: v for k, v in vars(args).items() if k not in ("out",)}
    report = {"benchmark": "serve_load", "config": config, "results": result, **_environment()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
