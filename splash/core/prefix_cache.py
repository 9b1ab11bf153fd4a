"""Automatic prefix caching: full KV pages keyed by the hash chain of their tokens.

Design (vLLM's hashed-page automatic prefix caching rather than SGLang's radix tree): a page
holding tokens [i·PS, (i+1)·PS) of a history is keyed by hash(key of page i-1, its tokens), so
equal keys mean equal histories up to the page's end. The engine already manages KV in fixed
pages with per-rank block tables, a layout switch moves pages, and the manifests name pages:
keying whole pages fits all three, where a radix tree's token-granular nodes would have to be
split and re-joined at page boundaries in every layout. Each rank keeps its own hash -> page
map (in its `PageAllocator`, with reference counts and the LRU order of unreferenced cached
pages), so the layouts need no special cases:

- a page is a hit under a layout when every rank that would hold it there (its holders:
  every rank in TP, rank i % T in CP, the owner in DP/DOP) has the key cached;
- a computed page is registered on each of its holders;
- admission in DP/DOP picks the owner from each rank's longest hit (`Scheduler`);
- a layout switch moves referenced and unreferenced cached pages alike (`cached_histories`
  turns the unreferenced ones into histories the switch manifest moves), and registers every
  moved page under its key on its new holder, so hits survive the switch.

Hits stop one token short of the history: the last token is always computed, for its logits.
Pages are registered when scheduled (before the step computes them): each layout writes a
step's KV rows before any of its attention reads, so a request scheduled behind another in the
same step may already share its pages.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field

import numpy as np

from splash.core.allocator import RankAllocators
from splash.core.ownership import KVPlacement, Layout, holds, local_page_index, page_holders


def hash_page(parent: bytes | None, tokens: list[int]) -> bytes:
    """Key of a full page: a 128-bit BLAKE2b digest of the previous page's key and its tokens."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


@dataclass
class CachedHistory:
    """An unreferenced chain of cached pages, shaped like a request for the switch manifest."""

    request_id: str
    tables: list[list[int]]  # per rank: pages in logical order (as a request's block tables)
    owner: int
    block_hashes: list[bytes]
    num_computed: int = 0
    num_cached_pages: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_cached_pages = len(self.block_hashes)


class PrefixCache:
    """Controller side of the per-rank caches: lookups and registration under a layout, and
    the hit counters ``stats()`` reports."""

    def __init__(self, allocators: RankAllocators, world: int, page_size: int,
                 enabled: bool = True) -> None:
        self.alloc, self.world, self.page_size = allocators, world, page_size
        self.enabled = enabled
        self.hit_tokens = 0  # tokens taken from the cache instead of computed
        self.queried_tokens = 0  # tokens of the requests looked up at admission

    def hashes(self, req) -> list[bytes]:
        """The keys of ``req``'s full pages (computed once, extended as it grows)."""
        ps, keys = self.page_size, req.block_hashes
        full = req.num_tokens // ps
        if len(keys) < full:
            tokens = req.prompt_token_ids + req.output_token_ids
            for i in range(len(keys), full):
                keys.append(hash_page(keys[-1] if keys else None, tokens[i * ps:(i + 1) * ps]))
        return keys

    def match(self, req, layout: Layout, owner: int) -> list[list[tuple[int, int]]]:
        """Cached pages that continue ``req``'s history from its next page (it must stand at a
        page boundary): per page, the (rank, page) of each of its holders."""
        if not self.enabled or req.params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt row computed
        if req.num_computed % self.page_size:
            return []
        keys = self.hashes(req)
        last = (req.num_tokens - 1) // self.page_size  # leave the last token to compute
        found: list[list[tuple[int, int]]] = []
        for i in range(req.num_computed // self.page_size, min(last, len(keys))):
            holders = page_holders(layout, i, owner, self.world)
            pages = [(d, self.alloc[d].lookup(keys[i])) for d in holders]
            if any(p is None for _, p in pages):
                break
            found.append([(d, p) for d, p in pages if p is not None])
        return found

    def register(self, req, layout: Layout, num_tokens: int) -> None:
        """Register ``req``'s full pages up to ``num_tokens`` (computed by the end of this step)
        on their holders."""
        if not self.enabled:
            return
        # a token still in flight is not known yet: its page registers once it is
        full = min(num_tokens, req.num_tokens) // self.page_size
        if full <= req.num_cached_pages:
            return
        keys = self.hashes(req)
        for i in range(req.num_cached_pages, full):
            local = local_page_index(layout, i, self.world)
            for d in page_holders(layout, i, req.owner, self.world):
                self.alloc[d].register(req.tables[d][local], keys[i], keys[i - 1] if i else None, i)
        req.num_cached_pages = full

    def register_moved(self, history, layout: Layout) -> None:
        """After a switch to ``layout``: register every cached page of ``history`` on its new
        holders (kept pages are registered already; received ones are not yet)."""
        if not self.enabled or not history.num_cached_pages:
            return
        keys = history.block_hashes
        parents = [None, *keys]
        logical = np.arange(history.num_cached_pages)
        for d in range(self.world):
            table = history.tables[d]
            mine = logical[holds(layout, d, logical, history.owner, self.world)]
            mine = mine[:len(table)]  # a holder's pages sit at local indices 0, 1, ...
            self.alloc[d].register_many(table[:len(mine)], _pick(keys, mine),
                                        _pick(parents, mine), mine.tolist())

    def clear(self) -> None:
        self.alloc.clear_cache()


def _pick(items: list, at: np.ndarray) -> list:
    """``items`` at indices ``at`` (a slice when they are evenly spaced)."""
    steps = np.diff(at)
    if len(at) and (len(at) == 1 or (steps[0] > 0 and (steps == steps[0]).all())):
        step = int(steps[0]) if len(at) > 1 else 1
        return items[int(at[0]):int(at[-1]) + 1:step]
    return [items[i] for i in at.tolist()]


def cached_histories(alloc: RankAllocators, layout: Layout, world: int,
                     page_size: int) -> list[CachedHistory]:
    """Every cached chain complete under ``layout`` (each page on all its holders, from the
    first page on) as a history ending at a leaf; chains sharing pages share them here too."""
    maps = [alloc[d].cached_blocks() for d in range(world)]
    out: list[CachedHistory] = []
    if layout.kv is KVPlacement.OWNED:
        for owner in range(world):
            out += _chains(maps, layout, world, page_size, owner, lambda key, o=owner: key in maps[o])
        return out
    if layout.kv is KVPlacement.REPLICATED:
        return _chains(maps, layout, world, page_size, 0, lambda key: all(key in m for m in maps))
    return _chains(maps, layout, world, page_size, 0,
                   lambda key: any(key in m and m[key].logical % world == d
                                   for d, m in enumerate(maps)))


def _chains(maps, layout: Layout, world: int, page_size: int, owner: int,
            complete) -> list[CachedHistory]:
    blocks = {}
    for m in maps:
        for key, b in m.items():
            if complete(key):
                blocks[key] = b
    valid: dict[bytes, bool] = {}

    def is_valid(key: bytes) -> bool:  # complete from the first page on
        chain = []
        while key not in valid:
            b = blocks.get(key)
            if b is None:
                valid[key] = False
                break
            chain.append(key)
            if b.parent is None:
                valid[key] = True
                break
            key = b.parent
        ok = valid[key]
        for k in chain:
            valid[k] = ok
        return ok

    good = [k for k in blocks if is_valid(k)]
    parents = {blocks[k].parent for k in good}
    out = []
    for leaf in (k for k in good if k not in parents):
        keys = [leaf]
        while blocks[keys[-1]].parent is not None:
            keys.append(blocks[keys[-1]].parent)  # type: ignore[arg-type]
        keys.reverse()
        tables: list[list[int]] = [[] for _ in range(world)]
        for i, key in enumerate(keys):
            for d in page_holders(layout, i, owner, world):
                tables[d].append(maps[d][key].page)
        out.append(CachedHistory(f"\x00cached-{owner}-{leaf.hex()}", tables, owner, keys,
                                 len(keys) * page_size))
    return out
