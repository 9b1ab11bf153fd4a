"""Controller time to plan a switch, per direction: the manifest of a pre-copy, the handoff's
delta, adopting the delta (`Scheduler.apply_switch`) and registering the moved pages in the prefix
cache (`Scheduler.register_switched`, which the engine runs once the switching step is submitted,
off its critical path). CPU only: the
controller holds no device tensors.

    python benchmarks/switch_planning.py --tp 2 4 8 --batch 16 --context 32768 --page-size 64

Each request's history is placed as the engine places it under the source layout (owners
round-robin); the pre-copy is planned when every request stands 3 rows short of ``context``
(+ its index, so last pages are partly filled), the delta after those 3 rows (decodes during
the pre-copy), with the pre-copy's owners, rows and pages. Every full page is registered in
the prefix cache beforehand, as the engine does. Figures are medians over ``--reps`` runs.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time

import numpy as np
from _results import save_json  # noqa: E402  (benchmarks/ is on sys.path)

from splash.core.allocator import RankAllocators
from splash.core.ownership import LAYOUTS, num_local_pages
from splash.core.request import Request
from splash.engine.scheduler import Scheduler, SchedulerConfig
from splash.sampling_params import SamplingParams
from splash.switching.manifest import build_manifest

HEADS = 128  # DeepSeek-V3's attention heads
DELTA_ROWS = 3  # rows written during the pre-copy


def _running(src: str, world: int, batch: int, context: int, ps: int) -> Scheduler:
    lay = LAYOUTS[src]
    pages = batch * (-(-(context + batch) // ps))
    sched = Scheduler(SchedulerConfig(world, ps, 2 * context), RankAllocators(world, 3 * pages),
                      lay)
    for i in range(batch):
        req = Request(f"r{i}", [1] * 4, SamplingParams())
        req.num_computed, req.owner = context + i - DELTA_ROWS, i % world
        req.tables = [[] for _ in range(world)]
        _grow(sched, req, context + i)
        req.block_hashes = [os.urandom(16) for _ in range((context + i) // ps)]
        req.num_cached_pages = len(req.block_hashes)
        sched.prefix.register_moved(req, lay)
        sched.running.append(req)
    return sched


def _grow(sched: Scheduler, req: Request, tokens: int) -> None:
    """Take the source pages ``tokens`` rows need (as the scheduler does before a step)."""
    n = -(-tokens // sched.cfg.page_size)
    for r in range(sched.cfg.world):
        more = num_local_pages(sched.layout, n, r, req.owner, sched.cfg.world) - len(req.tables[r])
        req.tables[r] += sched.alloc[r].allocate(more)


def _one(sched: Scheduler, dst: str) -> tuple[dict, tuple]:
    """Time the pre-copy, the delta and its adoption; returns the figures and the manifests."""
    reqs, alloc, world, ps = sched.running, sched.alloc, sched.cfg.world, sched.cfg.page_size
    s, d = sched.layout, LAYOUTS[dst]
    t0 = time.perf_counter()
    pre = build_manifest(s, d, reqs, alloc, world, ps, HEADS)
    t1 = time.perf_counter()
    assert pre is not None
    copied = {r.request_id: r.num_computed for r in reqs}
    for r in reqs:
        _grow(sched, r, r.num_computed + DELTA_ROWS)
        r.num_computed += DELTA_ROWS
    t2 = time.perf_counter()
    delta = build_manifest(s, d, reqs, alloc, world, ps, HEADS, owners=pre.new_owners,
                           rows_from=copied, staged=pre.placed)
    t3 = time.perf_counter()
    assert delta is not None
    sched.apply_switch(delta)
    t4 = time.perf_counter()
    sched.register_switched()  # the engine runs it once the step is submitted
    t5 = time.perf_counter()
    return {"precopy_ms": (t1 - t0) * 1e3, "handoff_ms": (t3 - t2) * 1e3,
            "apply_ms": (t4 - t3) * 1e3, "register_ms": (t5 - t4) * 1e3,
            "precopy_kv_rows": sum(x.kv_rows_received for x in pre.summary),
            "delta_kv_rows": sum(x.kv_rows_received for x in delta.summary)}, (pre, delta)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4, 8], help="ranks per group")
    ap.add_argument("--batch", type=int, default=16, help="running requests")
    ap.add_argument("--context", type=int, default=32768, help="KV rows per request")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--reps", type=int, default=9, help="runs per direction (median)")
    ap.add_argument("--out", default="benchmarks/results/cpu/switch_planning.json")
    args = ap.parse_args()
    rows = []
    print(f"{'T':>2} {'direction':>9} {'pre-copy ms':>11} {'handoff ms':>10} {'apply ms':>8} "
          f"{'register ms':>11}")
    for world, (src, dst) in itertools.product(args.tp, itertools.permutations(LAYOUTS, 2)):
        runs: list[dict] = []
        alive: list = []  # the last run's state, dropped once this run's exists: its memory
        for _ in range(args.reps):  # is reused, as a running engine reuses memory
            sched = _running(src, world, args.batch, args.context, args.page_size)
            alive.clear()
            row, manifests = _one(sched, dst)
            runs.append(row)
            alive += [sched, manifests]
        row = {"tp": world, "src": src, "dst": dst,
               **{k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}}
        print(f"{world:>2} {src + '->' + dst:>9} {row['precopy_ms']:>11.2f} "
              f"{row['handoff_ms']:>10.2f} {row['apply_ms']:>8.2f} {row['register_ms']:>11.2f}",
              flush=True)
        rows.append(row)
    save_json(args.out, {"benchmark": "switch_planning", "numpy": np.__version__,
                         "batch": args.batch,
                         "context": args.context, "page_size": args.page_size,
                         "reps": args.reps, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
