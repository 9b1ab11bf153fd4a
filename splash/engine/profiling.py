"""The profiling steps a worker runs before its KV pool exists (`splash.engine.memory_plan`):
the largest prefill chunk and the largest decode batch the scheduler may build, both at the
longest context, so that their peak activation memory can be measured and reserved.

The steps read and write real kernels over a one-page pool: every block-table entry of the
dummy requests points at page 0 (the values computed are meaningless; the shapes, the launch
configurations and hence the memory are those of the real steps).

The context is capped at ``PROFILE_CONTEXT``: beyond it no buffer of a step grows (the decode
kernels' split-KV partials stop growing at 64 splits of 256 tokens; DSA's indexer scores are
bounded per call and counted in full by the analytic floor of the reserve), while the time the
steps take does — a 2,048-row chunk attending over a 160K-token history took minutes in fp32.
"""

from __future__ import annotations

from splash.core.ownership import get_layout, num_local_pages
from splash.core.protocol import WORKER_PROTOCOL_VERSION, SeqSampling, StepPlan

PROFILE_PAGES = 1  # the pool the profiling steps run over
PROFILE_CONTEXT = 16384  # the longest context the profiling steps run at (see above)
_SAMPLING = SeqSampling(temperature=1.0, top_p=0.9, top_k=0, seed=None)  # the costliest path


def _plan(layout: str, rows: list[int], context: int, owners: list[int], sample: bool,
          step: int) -> StepPlan:
    ids = [f"\x00profile-{i}" for i in range(len(rows))]
    positions = [p for n in rows for p in range(context - n, context)]
    return StepPlan(WORKER_PROTOCOL_VERSION, step, layout, ids, rows, [context] * len(rows),
                    owners, [0] * len(positions), positions, [sample] * len(rows),
                    [_SAMPLING] * len(rows), [0] * len(rows))


def profile_context(context: int) -> int:
    """The context the profiling steps run at for a longest context of ``context``."""
    return min(max(context, 1), PROFILE_CONTEXT)


def profile_plans(layout: str, world: int, prefill_rows: int, decode_rows: int,
                  context: int) -> list[StepPlan]:
    """The prefill chunk (``prefill_rows`` rows, each request's last rows of a ``context``-long
    history: one request, or as many as a chunk longer than a context needs) and the decode
    batch (``decode_rows`` requests at ``context``, every one sampled), all owned by rank 0:
    the busiest rank under owned-KV layouts."""
    context = profile_context(context)
    plans = []
    if prefill_rows:
        rows = [context] * (prefill_rows // context) + [prefill_rows % context]
        rows = [n for n in rows if n]
        plans.append(_plan(layout, rows, context, [0] * len(rows), False, -2))
    if decode_rows:
        plans.append(_plan(layout, [1] * decode_rows, context, [0] * decode_rows, True, -1))
    return plans


def profile_tables(plan: StepPlan, rank: int, world: int, page_size: int) -> dict[str, list[int]]:
    """This rank's block tables for ``plan``: as many local pages as the layout places here,
    all of them page 0."""
    layout = get_layout(plan.layout)
    logical = [-(-n // page_size) for n in plan.context_lens]
    return {rid: [0] * int(num_local_pages(layout, pages, rank, owner, world))
            for rid, pages, owner in zip(plan.request_ids, logical, plan.owners, strict=True)}
