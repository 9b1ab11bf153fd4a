"""Page allocators: the controller's single source of truth for every rank's KV pages.

Pages are reference counted: a page is shared by the requests whose block tables hold it (the
n samples of a prompt, requests with a common cached prefix). Each rank also keeps its part of
the prefix cache: full pages registered under the hash of their tokens (and of every token
before them). A cached page whose last reference goes stays cached, in LRU order, until an
allocation needs it; the tail pages of a freed history are evicted before its head.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from functools import partial
from typing import NamedTuple

from splash.errors import ConfigError


class CachedBlock(NamedTuple):
    """A page registered in a rank's prefix cache (a tuple: a switch registers thousands)."""

    page: int
    parent: bytes | None  # hash of the previous page of the history (None: the first page)
    logical: int  # logical page index in the history


_block = partial(tuple.__new__, CachedBlock)  # CachedBlock((page, parent, logical)), built in C


class PageAllocator:
    """One rank's physical pages."""

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ConfigError(f"a rank needs at least one KV page, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # unreferenced and not cached
        self._refs = [0] * num_pages
        self._cached: dict[bytes, CachedBlock] = {}  # hash -> page holding it
        self._hash_of: dict[int, bytes] = {}  # cached page -> its hash
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; LRU first

    @property
    def num_free(self) -> int:
        """Pages no request holds (cached ones included: they are reclaimed on demand)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    @property
    def num_available(self) -> int:
        """Pages that can still be handed out."""
        return self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_evictable(self) -> int:
        """Cached pages no request holds."""
        return len(self._evictable)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def allocate(self, n: int) -> list[int]:
        """``n`` pages with one reference each; evicts least recently used cached pages when
        the free list runs out."""
        if n > self.num_available:
            raise MemoryError(f"need {n} pages, {self.num_available} available")
        cut = max(len(self._free) - n, 0)  # free pages first, from the end of the list
        pages = self._free[cut:]
        del self._free[cut:]
        pages.reverse()
        for _ in range(n - len(pages)):
            page, _ = self._evictable.popitem(last=False)
            del self._cached[self._hash_of.pop(page)]
            pages.append(page)
        refs = self._refs
        for page in pages:
            refs[page] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        for page in pages:
            if self._refs[page] == 0:
                if page not in self._evictable:
                    raise ValueError(f"page {page} is free; only held or cached pages are shared")
                del self._evictable[page]
            self._refs[page] += 1

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page; an unreferenced page returns to the free list, or,
        if cached, to the end of the LRU order (the last page of ``pages`` is evicted first)."""
        refs, hash_of, free = self._refs, self._hash_of, self._free
        for page in reversed(pages):
            n = refs[page]
            if n <= 0:
                raise ValueError(f"page {page} freed more often than it was held")
            refs[page] = n - 1
            if n == 1:
                if page in hash_of:
                    self._evictable[page] = None
                else:
                    free.append(page)

    # -- prefix cache ---------------------------------------------------------------------
    def register(self, page: int, key: bytes, parent: bytes | None, index: int) -> None:
        """Cache a held, full page under ``key``; a no-op when another page already holds it
        (that page stays the cached one) or this page is cached already."""
        self.register_many((page,), (key,), (parent,), (index,))

    def register_many(self, pages: Sequence[int], keys: Sequence[bytes],
                      parents: Sequence[bytes | None], indices: Sequence[int]) -> None:
        """`register` each page in turn; the pages and the keys of one call are distinct (one
        history's). Dictionary updates in bulk: a switch registers thousands."""
        cached, hash_of, refs = self._cached, self._hash_of, self._refs
        known, taken = cached.keys() & keys, hash_of.keys() & pages
        if len(known) == len(keys):
            return  # every key cached already (the pages a rank kept)
        if known or taken:
            new = [i for i, (key, page) in enumerate(zip(keys, pages))
                   if key not in known and page not in taken]
            pages, keys = [pages[i] for i in new], [keys[i] for i in new]
            parents, indices = [parents[i] for i in new], [indices[i] for i in new]
        cached.update(zip(keys, map(_block, zip(pages, parents, indices))))
        hash_of.update(zip(pages, keys))
        self._evictable.update((page, None) for page in pages if refs[page] == 0)

    def lookup(self, key: bytes) -> int | None:
        block = self._cached.get(key)
        return None if block is None else block.page

    def evictable_keys(self) -> list[bytes]:
        """The keys of the cached pages no request holds."""
        hash_of = self._hash_of
        return [hash_of[page] for page in self._evictable]

    def lookup_many(self, keys: Sequence[bytes]) -> list[int]:
        """`lookup` of each key, -1 where none is cached."""
        get = self._cached.get
        return [-1 if b is None else b.page for b in map(get, keys)]

    def cached_blocks(self) -> dict[bytes, CachedBlock]:
        return self._cached

    def clear_cache(self) -> None:
        """Forget every cached page (new weights make their KV stale)."""
        self._cached.clear()
        self._hash_of.clear()
        self._free.extend(reversed(self._evictable))
        self._evictable.clear()


class RankAllocators:
    """One allocator per rank, with all-or-nothing multi-rank allocation."""

    def __init__(self, world: int, num_pages: int) -> None:
        self.ranks = [PageAllocator(num_pages) for _ in range(world)]

    def __getitem__(self, rank: int) -> PageAllocator:
        return self.ranks[rank]

    def can_allocate(self, need: list[int]) -> bool:
        return all(n <= a.num_available for n, a in zip(need, self.ranks))

    def allocate(self, need: list[int]) -> list[list[int]]:
        if not self.can_allocate(need):
            raise MemoryError("not enough pages")
        return [a.allocate(n) for n, a in zip(need, self.ranks)]

    def used(self) -> list[int]:
        return [a.num_used for a in self.ranks]

    def clear_cache(self) -> None:
        for a in self.ranks:
            a.clear_cache()
