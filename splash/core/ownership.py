"""The ownership model: who holds which heads, KV pages and tokens under each layout.

A layout is two placements: where the head projections (Q-B, KV-B, O) live and where each
request's KV history lives. Everything layout-specific that is not compute is derived here and
nowhere else: which heads a rank holds, which ranks hold a page and at which local index, how
many pages and tokens of a history a rank holds, which rank owns a request under an owned layout,
where CP's per-rank rows land when a prefill gathers them, and the KV capacity of a pool. The
scheduler, the switch manifests, the attention layouts, the feasibility checks, the cost model
and the simulator all call these functions, so the placement the planner models is the one the
engine makes. The page and token functions take scalars or numpy arrays (one entry per request).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np

from splash.errors import InvalidRequestError


class ProjPlacement(str, Enum):
    SHARDED = "sharded"  # heads split 1/T over ranks
    REPLICATED = "replicated"  # every rank holds every head


class KVPlacement(str, Enum):
    REPLICATED = "replicated"  # every rank holds the whole history
    OWNED = "owned"  # one owner rank holds the whole history
    POSITION_SHARDED = "position_sharded"  # page i of a request lives on rank i % T


@dataclass(frozen=True)
class Layout:
    name: str
    projections: ProjPlacement
    kv: KVPlacement

    @property
    def shards_heads(self) -> bool:
        return self.projections is ProjPlacement.SHARDED

    @property
    def uses_owners(self) -> bool:
        return self.kv is KVPlacement.OWNED


LAYOUTS: dict[str, Layout] = {
    "tp": Layout("tp", ProjPlacement.SHARDED, KVPlacement.REPLICATED),
    "dp": Layout("dp", ProjPlacement.REPLICATED, KVPlacement.OWNED),
    "cp": Layout("cp", ProjPlacement.REPLICATED, KVPlacement.POSITION_SHARDED),
    "dop": Layout("dop", ProjPlacement.SHARDED, KVPlacement.OWNED),
}
LAYOUT_NAMES: tuple[str, ...] = tuple(LAYOUTS)


def get_layout(name: str) -> Layout:
    """The layout called ``name``; an unknown name is an InvalidRequestError (a ValueError)."""
    try:
        return LAYOUTS[name.lower()]
    except (KeyError, AttributeError):
        raise InvalidRequestError(
            f"unknown layout {name!r}; choose from {list(LAYOUTS)}") from None


# --- projections -------------------------------------------------------------------------


def heads_held(layout: Layout, rank: int, world: int, num_heads: int) -> range:
    """The head range rank ``rank`` holds of Q-B, KV-B and O."""
    if layout.projections is ProjPlacement.REPLICATED or world == 1:
        return range(num_heads)
    per = num_heads // world
    return range(rank * per, (rank + 1) * per)


def fitting_layouts(num_heads: int, world: int) -> list[str]:
    """Layouts whose head sharding divides ``num_heads`` evenly over ``world`` ranks."""
    return [
        name
        for name, lay in LAYOUTS.items()
        if not lay.shards_heads or world == 1 or num_heads % world == 0
    ]


# --- KV pages and tokens (scalars or arrays, one entry per request) ------------------------


def _int(x: Any) -> Any:
    """Plain ints for scalar inputs, arrays for array inputs."""
    return int(x) if np.ndim(x) == 0 else x


def holds(layout: Layout, rank: int, logical_pages: np.ndarray, owners: np.ndarray,
          world: int) -> np.ndarray:
    """Whether rank ``rank`` holds each logical page (of a request owned by ``owners``, same
    shape), as a bool array."""
    logical = np.asarray(logical_pages)
    if layout.kv is KVPlacement.REPLICATED:
        return np.ones(logical.shape, dtype=bool)
    if layout.kv is KVPlacement.OWNED:
        return np.broadcast_to(np.asarray(owners) == rank, logical.shape).copy()
    return logical % world == rank


def holders(layout: Layout, logical_pages: np.ndarray, owners: np.ndarray,
            world: int) -> np.ndarray:
    """`holds` for every rank at once: (pages, world) bools, row i the holders of page i."""
    logical = np.asarray(logical_pages)
    if layout.kv is KVPlacement.REPLICATED:
        return np.ones((*logical.shape, world), dtype=bool)
    one_hot = np.eye(world, dtype=bool)
    if layout.kv is KVPlacement.OWNED:
        return one_hot.take(np.broadcast_to(owners, logical.shape), axis=0)
    return one_hot.take(logical % world, axis=0)


def page_holders(layout: Layout, logical_page: int, owner: int, world: int) -> tuple[int, ...]:
    """Ranks that hold logical page ``logical_page`` of a request with owner ``owner``."""
    if layout.kv is KVPlacement.REPLICATED:
        return tuple(range(world))
    if layout.kv is KVPlacement.OWNED:
        return (owner,)
    return (logical_page % world,)


def local_page_index(layout: Layout, logical_page: Any, world: int) -> Any:
    """Index of a logical page in its holder's local block table."""
    if layout.kv is KVPlacement.POSITION_SHARDED:
        return logical_page // world
    return logical_page


def num_local_pages(layout: Layout, num_pages: Any, rank: int, owner: Any, world: int) -> Any:
    """How many of a request's ``num_pages`` logical pages rank ``rank`` holds."""
    pages = np.asarray(num_pages, dtype=np.int64)
    if layout.kv is KVPlacement.REPLICATED:
        held = pages
    elif layout.kv is KVPlacement.OWNED:
        held = np.where(np.asarray(owner) == rank, pages, 0)
    else:  # pages rank, rank + T, rank + 2T, ...
        held = np.maximum((pages - rank + world - 1) // world, 0)
    return _int(held)


def local_kv_len(layout: Layout, context_len: Any, rank: int, owner: Any, world: int,
                 page_size: int) -> Any:
    """Tokens of a ``context_len``-long history that rank ``rank`` holds."""
    ctx = np.asarray(context_len, dtype=np.int64)
    if layout.kv is not KVPlacement.POSITION_SHARDED:
        return _int(num_local_pages(layout, ctx, rank, owner, world))  # whole history or none
    full, tail = np.divmod(ctx, page_size)
    held = np.asarray(num_local_pages(layout, full, rank, owner, world)) * page_size
    return _int(held + np.where(full % world == rank, tail, 0))


def held_tokens(layout: Layout, tokens: Sequence[int] | np.ndarray, owners: Any, world: int,
                page_size: int, whole_pages: bool = True) -> np.ndarray:
    """KV tokens each rank holds of these histories, shape (world,): page-rounded (the pages
    taken) or exact. ``owners`` None under an owned layout: placed by ``assign_owners``."""
    tokens = np.asarray(tokens, dtype=np.int64)
    if layout.uses_owners and owners is None:
        owners = assign_owners(tokens, world)
    own = np.zeros(len(tokens), np.int64) if owners is None else np.asarray(owners, np.int64)
    held = np.zeros(world, dtype=np.int64)
    pages = -(-tokens // page_size)
    for rank in range(world):
        if whole_pages:
            held[rank] = int(np.sum(num_local_pages(layout, pages, rank, own, world))) * page_size
        else:
            held[rank] = int(np.sum(local_kv_len(layout, tokens, rank, own, world, page_size)))
    return held


def kv_capacity_tokens(layout: Layout, pages_per_rank: int, page_size: int, world: int) -> int:
    """Distinct KV tokens a group of ``world`` ranks with ``pages_per_rank`` free pages each
    holds under ``layout`` (a replicated history takes the same pages on every rank)."""
    per_rank = max(pages_per_rank, 0) * page_size
    return per_rank if layout.kv is KVPlacement.REPLICATED else per_rank * world


# --- owners ------------------------------------------------------------------------------


def least_loaded(load: Sequence[int], count: Sequence[int],
                 ranks: Sequence[int] | None = None) -> int | None:
    """The rank (of ``ranks``, default all) with the fewest KV tokens; ties: the fewest
    requests, then the lowest rank. None when ``ranks`` is empty."""
    cands = range(len(load)) if ranks is None else ranks
    return min(cands, key=lambda r: (load[r], count[r], r), default=None)


def assign_owners(tokens: Sequence[int] | np.ndarray, world: int) -> np.ndarray:
    """Owners of requests placed together (a switch into an owned layout): the largest history
    first (ties in the given order) onto ``least_loaded``'s rank."""
    tokens = np.asarray(tokens, dtype=np.int64)
    owners = np.zeros(len(tokens), dtype=np.int64)
    load, count = [0] * world, [0] * world
    for i in np.argsort(-tokens, kind="stable"):
        rank = least_loaded(load, count)
        assert rank is not None
        owners[i] = rank
        load[rank] += int(tokens[i])
        count[rank] += 1
    return owners


# --- CP prefill: every rank's held rows gathered into one buffer ---------------------------


@dataclass(frozen=True)
class GatherMap:
    """Rows of a set of CP histories, gathered rank by rank (rank 0's held rows of every
    request, then rank 1's, ...). Entry i of each array describes gathered row i."""

    counts: list[int]  # rows each rank contributes
    request: np.ndarray  # index of the row's request in the given list
    local_row: np.ndarray  # index of the row among the rows its rank holds of that request
    position: np.ndarray  # token position of the row in its request
    rank: np.ndarray  # rank that holds the row


def cp_gather_map(context_lens: Sequence[int] | np.ndarray, world: int,
                  page_size: int) -> GatherMap:
    """Where each rank's held rows of these CP histories sit in their requests; the k-th row
    rank r holds of a request is on logical page r + T * (k // page_size)."""
    cp = LAYOUTS["cp"]
    ctx = np.asarray(context_lens, dtype=np.int64)
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    counts = []
    for r in range(world):
        n = np.asarray(local_kv_len(cp, ctx, r, 0, world, page_size), dtype=np.int64)
        req = np.repeat(np.arange(len(ctx)), n)
        k = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
        pos = (r + world * (k // page_size)) * page_size + k % page_size
        parts.append((req, k, pos, np.full(len(k), r)))
        counts.append(int(n.sum()))
    req, k, pos, rank = (np.concatenate([p[i] for p in parts]) if parts else
                         np.zeros(0, np.int64) for i in range(4))
    return GatherMap(counts, req, k, pos, rank)
