"""The ownership model as data (DESIGN §1).

A layout is two placements: where the head projections (Q-B, KV-B, O) live and where each
request's KV history lives. Everything layout-specific that is not compute — which heads a rank
holds, which ranks hold a page, the local index of a page, per-rank memory, KV capacity, and
the switch manifests — is derived from these two choices by the functions below.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


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
    try:
        return LAYOUTS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown layout {name!r}; choose from {list(LAYOUTS)}") from None


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


# --- KV pages ----------------------------------------------------------------------------


def page_holders(layout: Layout, logical_page: int, owner: int, world: int) -> tuple[int, ...]:
    """Ranks that hold logical page ``logical_page`` of a request with owner ``owner``."""
    if layout.kv is KVPlacement.REPLICATED:
        return tuple(range(world))
    if layout.kv is KVPlacement.OWNED:
        return (owner,)
    return (logical_page % world,)


def local_page_index(layout: Layout, logical_page: int, world: int) -> int:
    """Index of a logical page in the holder's local block table."""
    if layout.kv is KVPlacement.POSITION_SHARDED:
        return logical_page // world
    return logical_page


def num_local_pages(layout: Layout, num_pages: int, rank: int, owner: int, world: int) -> int:
    """How many of a request's ``num_pages`` logical pages rank ``rank`` holds."""
    if layout.kv is KVPlacement.REPLICATED:
        return num_pages
    if layout.kv is KVPlacement.OWNED:
        return num_pages if rank == owner else 0
    return len(range(rank, num_pages, world))


def local_kv_len(
    layout: Layout, context_len: int, rank: int, owner: int, world: int, page_size: int
) -> int:
    """Tokens of a ``context_len``-long history that rank ``rank`` holds."""
    if layout.kv is KVPlacement.REPLICATED:
        return context_len
    if layout.kv is KVPlacement.OWNED:
        return context_len if rank == owner else 0
    full_pages, tail = divmod(context_len, page_size)
    held = len(range(rank, full_pages, world)) * page_size
    if tail and full_pages % world == rank:
        held += tail
    return held


def position_holders(layout: Layout, position: int, owner: int, world: int, page_size: int):
    """Ranks that store the KV row of ``position``, and its local page index there."""
    logical = position // page_size
    return page_holders(layout, logical, owner, world), local_page_index(layout, logical, world)
