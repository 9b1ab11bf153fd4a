"""The decode graphs a worker captures at start-up, before it reports ready.

Every layout whose projection placement the worker holds (`startup_layouts`), at every batch
bucket, at one block-table width. Each layout is captured with its own placement in use, the
start layout's placement first. The other placement's layouts follow only when every rank has
room for them: a rank that ran out of memory alone in the middle of a capture would leave its
peers waiting in the capture's collectives. Without room they are captured when a step first
needs them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from splash.dist.comm import Comm
from splash.engine.graphs import DecodeGraphs, startup_graph_keys
from splash.layouts.base import AttentionLayout
from splash.logging_utils import get_logger

logger = get_logger("splash.engine")

# free memory a rank needs per layout of the other placement, over what a layout of the start
# placement took
ROOM_MARGIN = 1.25


def room_for_other_placement(comm: Comm, device: torch.device, rank: int, names: list[str],
                             held: Callable[[str], range], start: range, before: int) -> bool:
    """Whether every rank has ``ROOM_MARGIN`` × the memory the start placement's graphs took
    per layout (reserved since ``before``) free for each layout of ``names`` computing with the
    other placement. Decided together, in one all-reduce."""
    same = sum(held(n) == start for n in names)
    per_layout = (torch.cuda.memory_reserved(device) - before) / max(same, 1)
    need = ROOM_MARGIN * per_layout * (len(names) - same)
    free = torch.cuda.mem_get_info(device)[0] + (
        torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    room = comm.all_agree(free >= need, device)
    if not room:
        logger.warning("rank %d: start-up graphs of layouts %s skipped (they need about %.0f "
                       "MiB; %.0f MiB free here, or less on a peer); captured when a step first "
                       "needs them", rank, [n for n in names if held(n) != start],
                       need / 2**20, free / 2**20)
    return room


def capture_startup(graphs: DecodeGraphs, impls: dict[str, AttentionLayout], comm: Comm,
                    device: torch.device, rank: int, world: int, names: list[str], width: int,
                    held: Callable[[str], range], use_heads: Callable[[range], None],
                    start: range) -> tuple[int, float, int]:
    """Capture the start-up graphs of layouts ``names`` at table ``width``, each with its
    placement (``held``, switched with ``use_heads``; ``start`` in use before and after).
    Returns (graphs held, seconds, bytes the graphs reserved)."""
    before = torch.cuda.memory_reserved(device)
    t0 = time.perf_counter()
    names.sort(key=lambda name: held(name) != start)  # the start placement first
    n, name, room = 0, names[0] if names else "", None
    try:
        with torch.inference_mode():  # as the steps that replay them
            for name in names:
                if held(name) != start:
                    if room is None:
                        room = room_for_other_placement(comm, device, rank, names, held, start,
                                                        before)
                    if not room:
                        break
                use_heads(held(name))
                n = graphs.capture_keys(startup_graph_keys([name], graphs.buckets, [width],
                                                           world), impls)
    except torch.OutOfMemoryError as e:
        if held(name) == start:
            raise RuntimeError(
                f"capturing the start-up CUDA graphs ran out of memory beyond their reserve "
                f"({e}): lower max_num_seqs (the largest graph batch), raise memory_fraction or "
                "set enforce_eager") from e
        torch.cuda.empty_cache()  # the other placement's graphs come when first needed
        logger.warning("rank %d: no memory left for the start-up graphs of layout %s (%s); they "
                       "are captured when a step first needs them", rank, name, e)
    finally:
        use_heads(start)
    secs = time.perf_counter() - t0
    used = torch.cuda.memory_reserved(device) - before
    logger.info("rank %d: captured %d CUDA graphs for layouts %s in %.1f s, %.0f MiB", rank, n,
                names, secs, used / 2**20)
    return n, secs, used
